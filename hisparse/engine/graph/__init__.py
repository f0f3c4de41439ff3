"""A GPU-bound decode step at DeepSeek-V3.2's attention shapes, captured and replayed as a CUDA
graph, in resident, always-host (HiSparse) and hybrid modes with bit-identical results.

Modules: `config` (shapes, the device-memory budget behind capacity), `model` (weights and the
bf16 math), `kernels` (Triton kernels for the row read and the indexer, used by every mode on
CUDA), `kv` (the indexer cache, resident rows, hot region and pinned host pool shared by all
modes), `step` (one decode step over batch parts; HiSparse parts go through
`hisparse.runtime`'s index groups), `replay` (selection drift, graph capture, timing, hit rate,
the eager phase profile). benchmarks/bench_decode_tpot.py drives it.

Bit-identity across modes needs cuBLAS's fixed-workspace mode (``CUBLAS_WORKSPACE_CONFIG``): a
step that copies on a side stream otherwise lets cuBLAS pick another reduction order for the
same GEMM, and the modes diverged at batch >= 64 on the H200. It is set here, if unset, for
processes that import this package before cuBLAS starts.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from hisparse.engine.graph.config import GraphConfig, MemoryBudget
from hisparse.engine.graph.kv import KVStore
from hisparse.engine.graph.model import Weights
from hisparse.engine.graph.replay import Drift, GraphStep, counters, hit_rate, profile_eager
from hisparse.engine.graph.step import MODES, DecodeStep, make_parts

__all__ = [
    "MODES",
    "DecodeStep",
    "Drift",
    "GraphConfig",
    "GraphStep",
    "KVStore",
    "MemoryBudget",
    "Weights",
    "counters",
    "hit_rate",
    "make_parts",
    "profile_eager",
]
