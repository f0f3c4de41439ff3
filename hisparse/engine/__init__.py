"""The engines that host HiSparse without a server: the reference sparse-MLA engine, the
DeepSeek-V3.2 / GLM-5 engine over the attention core (``dsa``) and the GPU-bound graph step
(``graph``); docs/engine.md's "Code map" says which module holds what.

May import: ``hisparse.connector``, ``hisparse.models``, ``hisparse.runtime``, ``hisparse.ops``;
never vLLM.
"""

from hisparse.engine.config import EngineConfig, request_lengths
from hisparse.engine.forward import MODES
from hisparse.engine.results import Parity, RunResult, RunStats, compare_runs
from hisparse.engine.run import run_workload
from hisparse.models.rows import ROW_FORMATS

__all__ = [
    "EngineConfig",
    "MODES",
    "Parity",
    "ROW_FORMATS",
    "RunResult",
    "RunStats",
    "compare_runs",
    "request_lengths",
    "run_workload",
]
