"""State rows: which request holds which row of the per-request residency state. Scheduler-side
bookkeeping, free of torch; the rows themselves live in each index group
(hisparse.runtime.index_group)."""

from __future__ import annotations

from typing import Optional

from hisparse.ops.limits import check_int


class StateRowAllocator:
    """Hands out state rows to requests; a freed row is reused by a later request."""

    def __init__(self, num_state_rows: int) -> None:
        self.num_state_rows = check_int("num_state_rows", num_state_rows, 1)
        self._free = list(range(num_state_rows - 1, -1, -1))
        self._owner: dict = {}

    def allocate(self, request_id) -> int:
        if request_id in self._owner:
            return self._owner[request_id]
        if not self._free:
            raise RuntimeError(
                f"no free state row for request {request_id!r}: all {self.num_state_rows} in use"
            )
        row = self._free.pop()
        self._owner[request_id] = row
        return row

    def free(self, request_id) -> Optional[int]:
        """Release the request's row; returns it (None if the request held none)."""
        row = self._owner.pop(request_id, None)
        if row is not None:
            self._free.append(row)
        return row

    def row_of(self, request_id) -> Optional[int]:
        return self._owner.get(request_id)

    @property
    def in_use(self) -> int:
        return len(self._owner)
