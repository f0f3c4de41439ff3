"""A GPU-bound decode step at DeepSeek-V3.2's attention shapes, captured and replayed as a CUDA
graph, in resident, always-host (HiSparse) and hybrid modes with bit-identical results.

Modules: `config` (shapes, the device-memory budget behind capacity), `model` (weights and the
bf16 math), `kernels` (Triton kernels for the row read and the indexer, used by every mode on
CUDA), `kv` (the indexer cache, resident rows, hot region and pinned host pool shared by all
modes), `step` (one decode step over batch parts; HiSparse parts go through
`hisparse.runtime`'s index groups), `replay` (selection drift, graph capture, timing, hit rate,
the eager phase profile). benchmarks/bench_decode_tpot.py drives it.

Bit-identity across modes rests on every kernel being deterministic for its inputs. cuBLAS's
fixed-workspace mode (``CUBLAS_WORKSPACE_CONFIG``) is set here, if unset, for processes that
import this package before cuBLAS starts: it fixes cuBLAS's reduction order whatever else runs.
The flips at batch >= 64 once blamed on cuBLAS were the benchmark's own drift (``replay.Drift``);
with that fixed, HiSparse (op copy, no overlap, in-read) stayed bit-identical to resident over 40
steps at batches 64 and 112 also without the setting (benchmarks/results/check_no_cublas_cfg_*).
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
