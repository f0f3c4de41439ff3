"""The small capacity-plan case that the plan tests check by hand (docs/plan.md)."""

from __future__ import annotations

# 4 layers in 2 index groups, 32-byte rows: small enough to compute every figure by hand.
SMALL_PLAN = dict(
    layers=4,
    row_bytes=32,
    top_k=8,
    index_share=2,
    indexer_key_bytes=8,
    gpu_mem_gib=1 / 1024,
    host_mem_gib=8 / 1024,
    context=1000,
    hot_size=16,
    miss_rate=0.25,
    pcie_gbps=1.0,
    batch=10,
)
