"""The runtime layer: one index group's resolve across its layers, which request holds which
state row, packed per-layer views of one allocation, the pinned host pool, and the host pool the
tensor-parallel ranks of one host share (with the flags that order its writes and reads).

May import: ``hisparse.ops``. Knows nothing of vLLM, the connector or the engine.
"""

from hisparse.runtime.index_group import HiSparseIndexGroup, HiSparseRuntime
from hisparse.runtime.residency import empty_residency, reset_residency
from hisparse.runtime.state_rows import StateRowAllocator

__all__ = [
    "HiSparseIndexGroup",
    "HiSparseRuntime",
    "StateRowAllocator",
    "empty_residency",
    "reset_residency",
]
