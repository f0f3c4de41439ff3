"""Per-step driving of one worker: apply the scheduler's metadata, map batch rows to state rows,
resolve each index group once and gather every member layer exactly once.

``StepDriver`` holds only what lives for one step (state rows, anchors, who resolved and who
gathered) on top of a fixed ``Registration``; writing new rows into the host pool is
``hisparse.connector.host_save``.
"""

from __future__ import annotations

from typing import Optional

import torch

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.registration import Registration
from hisparse.runtime import HiSparseRuntime
from hisparse.runtime.miss_plan import defer_misses


class StepDriver:
    """This step's state rows, anchors and resolve/gather bookkeeping."""

    def __init__(self, config: HiSparseConfig, reg: Registration) -> None:
        self.config = config
        self.reg = reg
        self.device = reg.device
        self.state_rows = torch.full(
            (config.max_num_seqs,), -1, dtype=torch.int32, device=reg.device
        )
        self.host_rows_in_use = 0
        self._resolved: set = set()  # groups whose leader resolved this step
        self._gathered: set = set()  # layers that gathered this step's plan
        self._plans: dict = {}  # layer -> MissPlan left to its row read this step
        self._row_of_slot: Optional[torch.Tensor] = None  # state row by anchor key (CUDA)
        self._anchors: Optional[torch.Tensor] = None  # keys set in _row_of_slot last step
        self._anchor_rows: Optional[dict] = None  # key -> [(state row, request id)], step order
        self._ended = False  # clear_connector_metadata came after the last start

    # ------------------------------------------------------------- metadata
    def start(self, meta: HiSparseConnectorMetadata) -> None:
        """Apply the scheduler's metadata: reset rows, drop rewritten keys, set state rows."""
        if not isinstance(meta, HiSparseConnectorMetadata):
            raise TypeError(
                f"metadata must be HiSparseConnectorMetadata, got {type(meta).__name__}"
            )
        self._check_metadata(meta)
        groups = self.reg.groups
        if meta.reset_rows:
            for g in groups:
                g.release(list(meta.reset_rows))
        if meta.invalidate:
            rows = [int(r) for r, _ in meta.invalidate]
            keys = [int(k) for _, k in meta.invalidate]
            for g in groups:
                g.invalidate_keys(rows, keys)
        self._check_all_gathered()
        padded = list(meta.state_rows) + [-1] * (self.config.max_num_seqs - len(meta.state_rows))
        self.state_rows.copy_(self._upload(padded))
        if meta.anchors:
            self._set_anchors(meta)
        else:  # a step without anchors (an empty step) must not answer with the last one's
            self._clear_anchors()
        self._resolved.clear()
        self._gathered.clear()
        self._plans.clear()
        self._ended = False
        self.host_rows_in_use = max(0, int(meta.host_rows_in_use))

    def next_pass(self) -> None:
        """Another forward within this step, a speculative draft's later pass: each group may
        resolve once more, its members having gathered the last plan (checked as at a step's
        start), so a second plan replaces nothing ungathered."""
        if self._ended:
            raise RuntimeError("next_pass after clear_connector_metadata ended the step")
        self._check_all_gathered()
        self._resolved.clear()
        self._gathered.clear()

    def end(self) -> None:
        """The step's metadata was cleared: until the next ``start`` nothing may resolve."""
        self._ended = True

    def _check_metadata(self, meta: HiSparseConnectorMetadata) -> None:
        S = self.config.max_num_seqs
        B = len(meta.state_rows)
        if B > S:
            raise ValueError(f"batch of {B} requests exceeds max_num_seqs = {S}")
        bad = [
            (rid, r)
            for rid, r in zip(meta.req_ids, meta.state_rows)
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < S
        ]
        if bad:
            raise ValueError(
                f"request {bad[0][0]!r}: state row {bad[0][1]!r} is not in [0, max_num_seqs = {S})"
            )
        # Checked with the rest, before any of the metadata takes effect.
        host_rows = self.reg.host_rows
        bad = [(r, k) for r, k in zip(meta.req_ids, meta.anchors) if not 0 <= int(k) < host_rows]
        if bad:
            raise ValueError(
                f"request {bad[0][0]!r}: anchor key {bad[0][1]} lies outside the "
                f"host pool's {host_rows} rows"
            )
        if len(set(meta.state_rows)) != B:
            raise ValueError(f"state_rows of one step must be distinct, got {meta.state_rows}")
        if meta.host_rows_in_use > self.reg.host_rows:
            raise ValueError(
                f"live requests hold {meta.host_rows_in_use} tokens but the host pool has "
                f"{self.reg.host_rows} rows: raise kv_connector_extra_config['host_pool_gib'] "
                "or admit fewer requests"
            )

    def _upload(self, values: list) -> torch.Tensor:
        src = torch.tensor(values, dtype=torch.int32)
        if self.device.type == "cuda":
            # From the caching host allocator: the block is not reused before the copy is done.
            return src.pin_memory().to(self.device, non_blocking=True)
        return src

    def _check_all_gathered(self) -> None:
        """Every member of a group that resolved last step must have gathered: the shared slot
        table already names the keys, so a member that skipped its copy would serve stale rows
        later. Every such group's hot state is dropped (nothing stale is ever read, whether the
        caller retries or goes on) and all of them are named in one error."""
        offending = []
        for g in self.reg.groups:
            if g.name not in self._resolved:
                continue
            skipped = [m.layer_name for m in g.members if m.layer_name not in self._gathered]
            if skipped:
                g.release(list(range(g.num_state_rows)))
                offending.append(
                    f"layer {skipped[0]!r} did not gather (resolve) in the step its leader "
                    f"{g.leader.layer_name!r} resolved"
                )
        if offending:
            # Nothing is left to check on a retry: every offending group was reset above.
            self._resolved.clear()
            self._gathered.clear()
            raise RuntimeError(
                f"{'; '.join(offending)}; the hot buffers of "
                f"{'its group were' if len(offending) == 1 else 'those groups were'} reset"
            )

    # -------------------------------------------------------------- anchors
    def _set_anchors(self, meta: HiSparseConnectorMetadata) -> None:
        host_rows = self.reg.host_rows
        keys = [int(k) for k in meta.anchors]
        self._anchor_rows = {}
        for k, row, rid in zip(keys, meta.state_rows, meta.req_ids):
            self._anchor_rows.setdefault(k, []).append((row, rid))
        if self.device.type == "cpu":
            return
        if self._row_of_slot is None:
            self._row_of_slot = torch.full((host_rows,), -1, dtype=torch.int32, device=self.device)
        elif self._anchors is not None:
            self._row_of_slot[self._anchors] = -1
        idx = self._upload(keys).long()
        self._row_of_slot[idx] = self._upload(list(meta.state_rows))
        self._anchors = idx

    def _clear_anchors(self) -> None:
        self._anchor_rows = None
        if self._row_of_slot is not None and self._anchors is not None:
            self._row_of_slot[self._anchors] = -1
            self._anchors = None

    def batch_state_rows(self, anchor_keys: torch.Tensor) -> torch.Tensor:
        """See ``HiSparseConnectorWorker.batch_state_rows``."""
        if self._anchor_rows is None:
            raise RuntimeError(
                "batch_state_rows needs step metadata with anchors "
                "(the scheduler side of this connector sends them)"
            )
        if not isinstance(anchor_keys, torch.Tensor) or anchor_keys.dim() != 1:
            raise ValueError("anchor_keys must be a 1-D tensor of keys")
        if self.device.type != "cpu":
            keys = anchor_keys.to(self.device, torch.long)
            return self._row_of_slot[keys.clamp(0, self.reg.host_rows - 1)]
        pending = {k: list(v) for k, v in self._anchor_rows.items()}
        rows = []
        for i, k in enumerate(anchor_keys.tolist()):
            if not pending.get(k):
                owners = sorted(rid for v in self._anchor_rows.values() for _, rid in v)
                raise RuntimeError(
                    f"batch row {i} ends at key {k}, which is no scheduled request's last token "
                    f"this step (scheduled: {owners})"
                )
            rows.append(pending[k].pop(0)[0])
        return torch.tensor(rows, dtype=torch.int32)

    # -------------------------------------------------------------- resolve
    def resolve(
        self,
        rt: HiSparseRuntime,
        top_k: Optional[torch.Tensor],
        resident_rows: Optional[torch.Tensor],
        state_rows: Optional[torch.Tensor],
        defer: bool = False,
    ) -> torch.Tensor:
        """See ``HiSparseConnectorWorker.resolve``."""
        g = rt.index_group
        if self._ended:
            raise RuntimeError(
                f"layer {rt.layer_name!r} resolves after clear_connector_metadata ended the step: "
                "call bind_connector_metadata(...) and start_load_kv(...) first"
            )
        if rt.is_leader:
            self._resolve_leader(rt, top_k, resident_rows, state_rows)
        elif g.name not in self._resolved:
            raise RuntimeError(
                f"layer {rt.layer_name!r} follows {g.leader.layer_name!r}, which has not "
                "resolved this step"
            )
        if rt.layer_name not in self._gathered:  # a second call must not copy (or count) again
            # The row read takes host rows at a fixed 1-row stride: a layer whose pool rows are
            # interleaved with its group's (co-located layouts) gathers instead.
            if defer and rt.host_rows_view.is_contiguous():
                self._plans[rt.layer_name] = defer_misses(rt)
            else:
                rt.gather()
            self._gathered.add(rt.layer_name)
        return g.out_rows[: g.batch]

    def miss_plan(self, layer_name: str):
        """The plan ``resolve(defer=True)`` left to the layer's read this step, or None."""
        return self._plans.get(layer_name)

    def _resolve_leader(self, rt, top_k, resident_rows, state_rows) -> None:
        g = rt.index_group
        if not isinstance(top_k, torch.Tensor) or top_k.dim() != 2:
            raise ValueError(f"top_k must be a 2-D int32 tensor [B, {g.top_k}]")
        if g.name in self._resolved:
            raise RuntimeError(
                f"layer {rt.layer_name!r} already resolved this step: a second plan would "
                "replace the one its member layers have not gathered yet"
            )
        n = top_k.shape[0]
        if n > self.config.max_num_seqs:
            raise ValueError(
                f"top_k has {n} rows, more than max_num_seqs = {self.config.max_num_seqs}"
            )
        if state_rows is None:
            state_rows = self.state_rows[:n]
        elif state_rows.shape != (n,):
            raise ValueError(
                f"state_rows must have shape ({n},) like top_k's rows, got "
                f"{tuple(state_rows.shape)}"
            )
        g.resolve(top_k, state_rows, resident_rows)
        self._resolved.add(g.name)
        for m in g.members:  # a new plan: no member has gathered or deferred it yet
            self._gathered.discard(m.layer_name)
            self._plans.pop(m.layer_name, None)
