"""The capacity model behind `hisparse plan` (formulas in docs/plan.md); the command's flags and
its report are in hisparse.cli.plan.

Per GPU (the MLA latent KV of a request is held whole by every rank that serves it, so the
per-GPU answer is also the per-tensor-parallel-group answer), for a decode batch at steady state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from hisparse.ops.limits import MAX_HOT_SIZE, ROW_ALIGN, check_int

GIB = 2**30

# Model presets. Indexer keys: a 128-dim FP8 key plus one float32 scale per token = 132 B, per
# index group (DeepSeek-V3.2: every layer has its indexer; GLM-5.x: one per 4 layers).
PRESETS = {
    "deepseek-v3.2": dict(
        layers=61, row_bytes=656, top_k=2048, index_share=1, indexer_key_bytes=132
    ),
    "glm-5.x": dict(layers=78, row_bytes=656, top_k=2048, index_share=4, indexer_key_bytes=132),
}
MODEL_FIELDS = ("layers", "row_bytes", "top_k", "index_share", "indexer_key_bytes")
# pcie_gbps is a placeholder: without --pcie-gbps, `hisparse plan` uses the rate measured for
# the pool's size and layout (hisparse.cli.plan_model).
DEFAULTS = dict(gpu_mem_gib=40.0, host_mem_gib=256.0, context=40960, miss_rate=0.05, pcie_gbps=46.0)


class PlanError(ValueError):
    """Inputs that cannot be planned (message names the flag)."""


@dataclass(frozen=True)
class PlanInputs:
    layers: int
    row_bytes: int
    top_k: int
    index_share: int
    indexer_key_bytes: int
    gpu_mem_gib: float
    host_mem_gib: float
    context: int
    hot_size: int
    miss_rate: float
    pcie_gbps: float
    batch: Optional[int] = None
    # Indexers, when the groups are uneven (a config's indexer_types); None: ceil(layers / share).
    index_groups: Optional[int] = None

    def __post_init__(self) -> None:
        pos_int = ("layers", "row_bytes", "top_k", "index_share", "context", "hot_size")
        for f in pos_int:
            check_int(f"argument --{f.replace('_', '-')}:", getattr(self, f), 1, error=PlanError)
        if self.row_bytes % ROW_ALIGN:
            raise PlanError(
                f"argument --row-bytes: must be a multiple of {ROW_ALIGN} (rows are "
                f"{ROW_ALIGN}-byte aligned), got {self.row_bytes}"
            )
        if self.indexer_key_bytes < 0:
            raise PlanError(
                f"argument --indexer-key-bytes: must be >= 0, got {self.indexer_key_bytes}"
            )
        if self.hot_size < self.top_k:
            raise PlanError(
                f"argument --hot-size: must be >= --top-k ({self.top_k}), got {self.hot_size}"
            )
        if self.hot_size > MAX_HOT_SIZE:
            raise PlanError(
                f"argument --hot-size: must be <= {MAX_HOT_SIZE} (slot ids are int16), "
                f"got {self.hot_size}"
            )
        if self.index_share > self.layers:
            raise PlanError(
                f"argument --index-share: must be <= --layers ({self.layers}), "
                f"got {self.index_share}"
            )
        if not (self.gpu_mem_gib > 0 and self.host_mem_gib >= 0 and self.pcie_gbps > 0):
            raise PlanError("argument --gpu-mem-gib/--pcie-gbps: must be > 0")
        if not 0.0 <= self.miss_rate <= 1.0:
            raise PlanError(f"argument --miss-rate: must be in [0, 1], got {self.miss_rate}")
        if self.batch is not None and self.batch < 1:
            raise PlanError(f"argument --batch: must be >= 1, got {self.batch}")
        if self.index_groups is not None and not 1 <= self.index_groups <= self.layers:
            raise PlanError(
                f"argument --index-share: {self.index_groups} index groups for {self.layers} layers"
            )


def compute(p: PlanInputs) -> dict:
    """Every number `hisparse plan` prints (see docs/plan.md for the formulas)."""
    L, b, k, s, e = p.layers, p.row_bytes, p.top_k, p.index_share, p.indexer_key_bytes
    T, m = p.context, p.miss_rate
    G = p.index_groups or math.ceil(L / s)  # index groups (= indexers)
    gpu = int(p.gpu_mem_gib * GIB)
    host = int(p.host_mem_gib * GIB)
    kv_per_token = L * b  # bytes of one token's rows, all layers
    idx_per_token = G * e  # its indexer keys, all groups
    resident_req = T * (kv_per_token + idx_per_token)
    hot_rows = min(p.hot_size, T)  # a hot buffer never needs more rows than tokens
    hisparse_dev_req = L * hot_rows * b + T * idx_per_token
    host_req = T * kv_per_token
    conc = _max_concurrency(gpu, host, resident_req, hisparse_dev_req, host_req)
    batch = p.batch if p.batch is not None else conc["hisparse"]
    misses_req = m * min(k, T)  # rows missed per request per index group per step
    h2d_step = batch * misses_req * L * b  # every member layer copies each miss
    return {
        "inputs": asdict(p),
        "index_groups": G,
        "bytes_per_request": {
            "resident_device": resident_req,
            "hisparse_device": hisparse_dev_req,
            "hisparse_host": host_req,
        },
        "max_concurrency": conc,
        "host_pool_bytes_at_max": conc["hisparse"] * host_req,
        "decode_step": {
            "batch": batch,
            "host_pool_bytes": batch * host_req,
            "misses_per_request_per_group": misses_req,
            "h2d_bytes": h2d_step,
            "h2d_ms": h2d_step / (p.pcie_gbps * 1e9) * 1e3,
            "pcie_gbps": p.pcie_gbps,
        },
        "hybrid": _hybrid(
            p,
            gpu,
            host,
            batch,
            resident_req,
            hisparse_dev_req,
            host_req,
            T * idx_per_token,
            misses_req * L * b,
            conc["hisparse_gpu_limit"],
        ),
        "notes": _notes(p, T, p.hot_size, k),
    }


def _max_concurrency(
    gpu: int, host: int, resident_req: int, hisparse_dev_req: int, host_req: int
) -> dict:
    """Requests that fit: resident (GPU only), HiSparse (the tighter of GPU and host)."""
    n_res = gpu // resident_req
    n_hs_gpu = gpu // hisparse_dev_req
    n_hs_host = host // host_req if host_req else 0
    n_hs = min(n_hs_gpu, n_hs_host)
    limit = (
        "GPU memory (hot buffers + indexer keys)" if n_hs_gpu <= n_hs_host else "host memory (pool)"
    )
    return {
        "resident": n_res,
        "hisparse": n_hs,
        "hisparse_gpu_limit": n_hs_gpu,
        "hisparse_host_limit": n_hs_host,
        "hisparse_limited_by": limit,
        "gain": (n_hs / n_res) if n_res else None,
    }


def hybrid_resident(batch: int, gpu: int, resident_req: int, hisparse_dev_req: int) -> int:
    """Hybrid residency: of `batch` running requests, how many keep all their KV in device
    memory; the rest are spilled (host pool + hot buffer). Every request keeps its indexer keys
    on the device, so a resident request costs `resident_req` and a spilled one
    `hisparse_dev_req`; the most that fit stay resident."""
    if batch * hisparse_dev_req > gpu:
        return -1  # not even all-spilled fits
    extra = resident_req - hisparse_dev_req
    if extra <= 0:
        return batch
    return int(min(batch, (gpu - batch * hisparse_dev_req) // extra))


def _hybrid(
    p, gpu, host, batch, resident_req, hisparse_dev_req, host_req, idx_req, miss_bytes_req, n_hs_gpu
) -> dict:
    """The hybrid mode's plan: spills start past the resident capacity; only spilled requests
    use the host pool and move rows host->device, so its host limit is looser than always-host's."""

    def fits(n):
        r = hybrid_resident(n, gpu, resident_req, hisparse_dev_req)
        return r >= 0 and (n - r) * host_req <= host

    lo, hi = 0, n_hs_gpu  # fits() is monotone in n: each added request adds >= one spill's need
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    n_hyb = lo
    limit = "GPU memory (hot buffers + indexer keys)" if n_hyb == n_hs_gpu else "host memory (pool)"
    r = hybrid_resident(batch, gpu, resident_req, hisparse_dev_req)
    out = {
        "max_concurrency": n_hyb,
        "limited_by": limit,
        "spills_above": gpu // resident_req,
        "batch": batch,
    }
    if r < 0:
        out.update(resident=None, spilled=None, host_pool_bytes=None, h2d_bytes=None, h2d_ms=None)
        return out
    spilled = batch - r
    h2d = spilled * miss_bytes_req
    out.update(
        resident=r,
        spilled=spilled,
        host_pool_bytes=spilled * host_req,
        h2d_bytes=h2d,
        h2d_ms=h2d / (p.pcie_gbps * 1e9) * 1e3,
    )
    return out


def _notes(p: PlanInputs, T: int, H: int, k: int) -> list:
    notes = []
    if T <= H:
        notes.append(
            f"context ({T}) <= hot size ({H}): every token fits in the hot buffer, HiSparse "
            "saves no device memory"
        )
    if T <= k:
        notes.append(f"context ({T}) <= top-k ({k}): attention is dense at this length")
    return notes
