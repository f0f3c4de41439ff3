"""Small pieces of the connector facade's life cycle: its role argument, request ids, the record
of preempted requests' state rows, and the sleep-mode refusal.

A request vLLM preempts gives its state row back (the scheduler half releases it, the worker
resets it next step) and gets a fresh one when vLLM resumes it and recomputes its KV; each
resumption is logged as one line, so a run shows that rows were released and reissued.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

# A name under vLLM's "vllm" logger, so vLLM's handler prints these lines (no vLLM import).
logger = logging.getLogger("vllm.hisparse")

SLEEP_MODE_REFUSAL = (
    "the HiSparse connector does not support vLLM's sleep mode (it would remap the KV cache "
    "under HiSparse's state rows and hot buffers): drop --enable-sleep-mode"
)


def connector_role(role: Any, roles: Any):
    """``roles`` (vLLM's or hisparse's KVConnectorRole) member for ``role``, which may also be
    'scheduler' / 'worker'."""
    if isinstance(role, roles):
        return role
    name = role.lower() if isinstance(role, str) else getattr(role, "name", None)
    if isinstance(name, str) and name.upper() in ("SCHEDULER", "WORKER"):
        return roles[name.upper()]
    raise ValueError(
        f"role must be KVConnectorRole.SCHEDULER/WORKER or 'scheduler'/'worker', got {role!r}"
    )


def request_id(request: Any) -> str:
    rid = getattr(request, "request_id", None)
    if rid is None:
        raise ValueError(f"request must have a request_id, got {type(request).__name__}")
    return rid


class Preemptions:
    """Preempted requests and the state row each gave back, until vLLM resumes them."""

    def __init__(self) -> None:
        self.released: dict = {}  # req_id -> state row released at its preemption
        self._pending: dict = {}  # this step's preempted requests, until the step is built
        self.resumed = 0

    def before(self, rows: Any, scheduler_output: Any) -> dict:
        """Before a step is built: the rows the step's preempted requests hold now."""
        held = {
            rid: rows.row_of(rid)
            for rid in getattr(scheduler_output, "preempted_req_ids", None) or ()
        }
        self._pending = {rid: row for rid, row in held.items() if row is not None}
        return self._pending

    def after(self, rows: Any, scheduled: Iterable[str]) -> None:
        """After the step was built (rows released and issued): log each resumption."""
        self.released.update(self._pending)
        self._pending = {}
        for rid in scheduled:
            if rid in self.released:
                self.resumed += 1
                logger.info(
                    "HiSparse: request %s resumed after preemption: state row %d was released, "
                    "row %d issued",
                    rid,
                    self.released.pop(rid),
                    rows.row_of(rid),
                )

    def forget(self, rid: str) -> None:
        """A request that finished (or was aborted) while preempted."""
        self.released.pop(rid, None)
