"""The scheduler half of the HiSparse connector: state rows per request, token counts, block
lists, and the metadata of every step (see docs/vllm.md for what it sends and why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.stats import HiSparseKVConnectorStats
from hisparse.ops.limits import INT32_MAX, as_index, check_int
from hisparse.runtime.state_rows import StateRowAllocator


@dataclass
class StepSchedule:
    """What the HiSparse scheduler reads of one engine step. ``num_scheduled_tokens``' order is
    the batch order. ``blocks``: where an engine pages KV in blocks (vLLM), {req_id:
    (num_computed_tokens, block_ids or None, replace)}, ``replace`` when the ids are the request's
    whole block list (a new or resumed request), else the blocks appended this step; empty
    otherwise (every held token is then a host row of its own)."""

    num_scheduled_tokens: dict
    finished_req_ids: set = field(default_factory=set)
    preempted_req_ids: Optional[set] = None
    blocks: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _token_counts(self.num_scheduled_tokens)


def _token_counts(scheduled: Any) -> dict:
    """{req_id: tokens} with every count an integer >= 1 (``as_index``): a negative count would
    drive the held tokens below zero and past the pool check, a fraction would be truncated."""
    if not isinstance(scheduled, Mapping):
        raise ValueError(
            "scheduler_output.num_scheduled_tokens must be a dict {req_id: tokens}, got "
            f"{type(scheduled).__name__}"
        )
    return {rid: as_index(f"num_scheduled_tokens[{rid!r}]", n, 1) for rid, n in scheduled.items()}


class HiSparseScheduler:
    """State rows per request, token counts, and what the worker must reset next step.

    With vLLM it also follows each request's block list, to send the worker the key of every
    request's last scheduled token (``anchors``: the model's layers see batch rows, not request
    ids) and to invalidate hot copies of positions that are written a second time."""

    def __init__(
        self, config: HiSparseConfig, metadata_class: type = HiSparseConnectorMetadata
    ) -> None:
        """``metadata_class``: what ``build`` returns, ``HiSparseConnectorMetadata`` or a
        subclass (the one vLLM ships between its processes)."""
        self.metadata_class = metadata_class
        self.rows = StateRowAllocator(config.max_num_seqs)
        self.max_num_seqs = config.max_num_seqs
        self.block_size = config.block_size
        # Positions past a step's scheduled tokens that a speculative draft's later passes write
        # (one each, num_speculative_tokens - 1 passes): rows of the draft's layers, cached hot
        # by its resolves, which the next step may write again.
        self.lookahead = max(0, config.decode_tokens - 2)
        self.tokens: dict = {}
        self.blocks: dict = {}
        self.block_refs: dict = {}  # vLLM block id -> live requests holding it (prefix sharing)
        self.pending_resets: list = []
        self.pending_invalidate: list = []
        # The host pool's rows (= the key space): with vLLM its KV blocks x block_size, without
        # it what the engine passes on (``set_host_rows``); None = unknown, keys are then only
        # checked against int32 here and against the pool by the worker.
        self.host_rows: Optional[int] = None

    def set_host_rows(self, host_rows: Any) -> None:
        """The worker's host-pool rows (``HiSparseConnectorWorker.host_rows``), so that keys and
        token counts past the pool are refused here, where they enter."""
        self.host_rows = check_int("host_rows", as_index("host_rows", host_rows), 1, INT32_MAX)

    def invalidate_keys(self, req_id: Any, keys: Any) -> None:
        """Positions of ``req_id`` were rewritten: drop their hot copies next step. Keys follow
        ``as_index`` (as in the runtime and the metadata) and must lie in the pool."""
        row = self.rows.row_of(req_id)
        if row is None:
            raise ValueError(f"request {req_id!r} holds no HiSparse state row")
        limit = self.host_rows or INT32_MAX
        what = "host_rows" if self.host_rows else "int32 keys"
        checked = [_key_in_pool(f"keys[{i}]", k, limit, what) for i, k in enumerate(_listed(keys))]
        self.pending_invalidate.extend((row, k) for k in checked)

    def gauges(self) -> Optional[HiSparseKVConnectorStats]:
        """Scheduler-side gauge samples, every step (vLLM appends them after the worker's, so
        they are the ones that stand): host-pool usage from the live requests' tokens, and hot
        rows in use = 0 once no request is live (the worker's snapshot still counts the rows of
        requests it has not yet been told are gone)."""
        if not self.host_rows:
            return None
        usage = min(1.0, self.rows_in_use() / self.host_rows)
        idle = not self.tokens
        stats = HiSparseKVConnectorStats()
        stats.record_snapshot(0, 0, 0, host_pool_usage=usage, hot_rows_in_use=0 if idle else None)
        return stats

    def rows_in_use(self) -> int:
        """Host rows held by live requests: with vLLM, their distinct blocks (requests sharing a
        cached prefix share its rows); otherwise their tokens."""
        if self.blocks:
            return len(self.block_refs) * self.block_size
        return sum(self.tokens.values())

    def _ref(self, ids, delta: int) -> None:
        for b in ids:
            n = self.block_refs.get(b, 0) + delta
            if n > 0:
                self.block_refs[b] = n
            else:
                self.block_refs.pop(b, None)

    def release(self, req_id) -> None:
        row = self.rows.free(req_id)
        self.tokens.pop(req_id, None)
        self._ref(self.blocks.pop(req_id, ()), -1)
        if row is not None:
            self.pending_resets.append(row)

    def _key(self, blocks: list, req_id, pos: int) -> int:
        b = pos // self.block_size
        if b >= len(blocks):
            raise ValueError(
                f"request {req_id!r}: position {pos} lies past its {len(blocks)} "
                f"blocks of {self.block_size} tokens"
            )
        return int(blocks[b]) * self.block_size + pos % self.block_size

    def build(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        """One step's metadata. Nothing changes unless it succeeds (a failing step leaves the
        state as it was, so a retry sees the same counts)."""
        scheduled = _token_counts(getattr(scheduler_output, "num_scheduled_tokens", None))
        gone = [
            rid
            for attr in ("finished_req_ids", "preempted_req_ids")
            for rid in getattr(scheduler_output, attr, None) or ()
        ]
        block_view = dict(getattr(scheduler_output, "blocks", None) or {})
        live = {rid for rid in self.tokens if rid not in gone}
        new_reqs = [rid for rid in scheduled if rid not in live]
        if len(live) + len(new_reqs) > self.max_num_seqs:
            raise RuntimeError(
                f"request {new_reqs[-1]!r} needs a HiSparse state row but all "
                f"kv_connector_extra_config['max_num_seqs'] = {self.max_num_seqs} are in use"
            )
        tokens, blocks, added, anchors, rewrites = self._plan_requests(scheduled, block_view, live)
        if not block_view:
            self._check_pool(tokens, live)
        # Commit.
        for rid in gone:
            self.release(rid)
        resets = self.pending_resets
        for rid in new_reqs:
            resets.append(self.rows.allocate(rid))
        self.tokens.update(tokens)
        for rid, ids in added.items():
            if ids is blocks[rid]:  # a whole (new or replaced) list
                self._ref(self.blocks.get(rid, ()), -1)
            self._ref(ids, +1)
        self.blocks.update(blocks)
        invalidate = list(self.pending_invalidate)
        invalidate.extend((self.rows.row_of(rid), key) for rid, key in rewrites)
        meta = self.metadata_class(
            req_ids=tuple(scheduled),
            state_rows=tuple(self.rows.row_of(rid) for rid in scheduled),
            reset_rows=tuple(dict.fromkeys(resets)),
            invalidate=tuple(invalidate),
            host_rows_in_use=self.rows_in_use(),
            anchors=tuple(anchors) if len(anchors) == len(scheduled) else (),
        )
        self.pending_resets, self.pending_invalidate = [], []
        return meta

    def _plan_requests(self, scheduled: Mapping, block_view: dict, live: set) -> tuple:
        """Each scheduled request's token count after this step and, with vLLM, its block list,
        the blocks it adds, its anchor key and the keys it writes a second time. Changes nothing
        (``build`` commits)."""
        tokens, blocks, added, anchors, rewrites = {}, {}, {}, [], []
        for rid, n in scheduled.items():
            if rid not in block_view:
                tokens[rid] = (self.tokens.get(rid, 0) if rid in live else 0) + n
                continue
            nc, ids, replace = block_view[rid]
            have = [] if replace or rid not in live else self.blocks.get(rid, [])
            blocks[rid] = have + (ids or [])
            added[rid] = blocks[rid] if not have else (ids or [])
            tokens[rid] = nc + n
            anchors.append(self._key(blocks[rid], rid, nc + n - 1))
            written = self.tokens.get(rid, 0) + self.lookahead if rid in live else 0
            rewrites.extend(
                (rid, self._key(blocks[rid], rid, p)) for p in range(nc, min(written, nc + n))
            )
        return tokens, blocks, added, anchors, rewrites

    def _check_pool(self, tokens: dict, live: set) -> None:
        """Without vLLM's block lists every held token is a host row: refuse a step whose live
        requests would hold more than the pool (with vLLM its own block pool is the bound)."""
        if not self.host_rows:
            return
        held = sum(n for rid, n in self.tokens.items() if rid in live and rid not in tokens)
        held += sum(tokens.values())
        if held > self.host_rows:
            raise ValueError(
                f"live requests would hold {held} tokens but the host pool has {self.host_rows} "
                "rows: raise kv_connector_extra_config['host_pool_gib'] or admit fewer requests"
            )


def _listed(keys: Any) -> list:
    try:
        return list(keys)
    except TypeError:
        raise ValueError(
            f"keys must be a sequence of host rows, got {type(keys).__name__}"
        ) from None


def _key_in_pool(name: str, key: Any, limit: int, what: str) -> int:
    k = as_index(name, key)
    if not 0 <= k < limit:
        raise ValueError(
            f"{name} = {k} lies outside the host pool: keys are in [0, {limit}) ({what})"
        )
    return k
