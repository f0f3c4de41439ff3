"""The reference sparse-MLA engine that hosts HiSparse (see docs/engine.md; its "Code map"
says which module holds what)."""

from hisparse.engine.config import EngineConfig, request_lengths
from hisparse.engine.forward import MODES
from hisparse.engine.results import Parity, RunResult, RunStats, compare_runs
from hisparse.engine.run import run_workload
from hisparse.models.rows import ROW_LAYOUTS

__all__ = [
    "EngineConfig",
    "MODES",
    "Parity",
    "ROW_LAYOUTS",
    "RunResult",
    "RunStats",
    "compare_runs",
    "request_lengths",
    "run_workload",
]
