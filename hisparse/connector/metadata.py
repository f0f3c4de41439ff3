"""The step metadata the scheduler half of the connector sends the worker half (picklable:
vLLM ships it between processes). Neutral ground: both halves import it, neither from the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse.ops.limits import as_index


@dataclass(frozen=True)
class HiSparseConnectorMetadata:
    """What the scheduler connector tells the worker connector for one step (picklable).

    req_ids: requests of the batch, in batch order (row b of ``top_k`` is ``req_ids[b]``).
    state_rows: the state row of each batch row.
    reset_rows: state rows to reset before the step (handed to a new request, or released).
    invalidate: (state_row, key) pairs whose hot copy must be dropped (position rewritten).
    host_rows_in_use: tokens held in the host pool by live requests (host-pool usage gauge).
    anchors: per request, the key (slot) of its last token scheduled this step, or empty. An
        engine whose layers see batch rows rather than request ids (vLLM) finds each row's
        state row through this (``batch_state_rows``).
    """

    req_ids: tuple = ()
    state_rows: tuple = ()
    reset_rows: tuple = ()
    invalidate: tuple = ()
    host_rows_in_use: int = 0
    anchors: tuple = ()

    def __post_init__(self) -> None:
        # Every number becomes a plain int by the rule the runtime and the scheduler apply
        # (``as_index``): numpy or torch integer scalars pass, bools and fractions are refused by
        # field name instead of being truncated or failing later on the worker.
        ints = lambda name, xs, lo: tuple(  # noqa: E731
            as_index(f"{name}[{i}]", x, lo) for i, x in enumerate(xs)
        )
        pairs = tuple(
            ints(f"invalidate[{i}]", p, None) if isinstance(p, (tuple, list)) and len(p) == 2 else p
            for i, p in enumerate(self.invalidate)
        )
        bad = [i for i, p in enumerate(pairs) if not isinstance(p, tuple)]
        if bad:
            got = self.invalidate[bad[0]]
            raise ValueError(f"invalidate[{bad[0]}] must be a (state_row, key) pair, got {got!r}")
        object.__setattr__(self, "req_ids", tuple(self.req_ids))
        object.__setattr__(self, "state_rows", ints("state_rows", self.state_rows, None))
        object.__setattr__(self, "reset_rows", ints("reset_rows", self.reset_rows, None))
        object.__setattr__(self, "invalidate", pairs)
        object.__setattr__(self, "anchors", ints("anchors", self.anchors, None))
        object.__setattr__(
            self, "host_rows_in_use", as_index("host_rows_in_use", self.host_rows_in_use, 0)
        )
        if len(self.req_ids) != len(self.state_rows):
            raise ValueError(
                f"req_ids and state_rows must have equal lengths, got {len(self.req_ids)} "
                f"and {len(self.state_rows)}"
            )
        if self.anchors and len(self.anchors) != len(self.req_ids):
            raise ValueError(
                f"anchors must have one entry per request, got {len(self.anchors)} for "
                f"{len(self.req_ids)} requests"
            )
