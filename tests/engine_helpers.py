"""Small reference-engine workloads for fast CPU tests."""

from __future__ import annotations

from hisparse.engine import EngineConfig

# Enough requests to reuse state rows, contexts several times the hot buffer.
SMALL = dict(
    num_layers=4,
    index_share=2,
    hidden=32,
    vocab=128,
    indexer_dim=16,
    top_k=16,
    hot_size=32,
    num_requests=6,
    max_running=3,
    prompt_len=72,
    output_len=14,
    recent_window=4,
    metrics_interval=5,
)


def small_config(**over) -> EngineConfig:
    return EngineConfig(**{**SMALL, **over})


# The same workload as CLI flags.
SMALL_FLAGS = [
    "--layers",
    "4",
    "--index-share",
    "2",
    "--top-k",
    "16",
    "--hot-size",
    "32",
    "--requests",
    "6",
    "--concurrency",
    "3",
    "--prompt-len",
    "72",
    "--output-len",
    "14",
    "--recent-window",
    "4",
    "--metrics-interval",
    "5",
]
