"""The graph step: layers of the DSA attention core (``hisparse.models.dsa.core``, the code the
vLLM classes run) at DeepSeek-V3.2's shapes with random weights, one decode step captured as one
CUDA graph per mode (resident, hisparse) and replayed; what benchmarks/bench_decode_tpot.py
times. It holds no model math of its own: the projections, the indexer, the row read and the
attention are ``hisparse.models.dsa``'s.

Modules: `config` (shapes, the device-memory budget behind capacity), `drift` (the staged
selection), `step` (the layers' weights, caches and rows; one step's forward), `replay` (capture,
interleaved timing, bit-identity between the modes, the hit rate).

Bit-identity across modes rests on every kernel being deterministic for its inputs. cuBLAS's
fixed-workspace mode (``CUBLAS_WORKSPACE_CONFIG``) is set here, if unset, for processes that
import this package before cuBLAS starts: it fixes cuBLAS's reduction order whatever else runs.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from hisparse.engine.graph.config import GraphConfig, MemoryBudget
from hisparse.engine.graph.drift import Drift
from hisparse.engine.graph.replay import Captured, hit_counts, measure
from hisparse.engine.graph.step import MODES, CoreStep

__all__ = [
    "MODES",
    "Captured",
    "CoreStep",
    "Drift",
    "GraphConfig",
    "MemoryBudget",
    "hit_counts",
    "measure",
]
