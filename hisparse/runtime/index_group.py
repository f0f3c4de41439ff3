"""Per-step HiSparse state: index groups (residency state, counters, miss plan) and per-layer
runtimes (host view, hot view).

The leader layer of a group resolves once per step; every member gathers the same plan into its
own hot view from its own host view. On CUDA the gathers run on the group's copy stream and each
layer's attention waits only for its own rows (`wait_ready`).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from hisparse import ops
from hisparse.ops.limits import INT32_MAX, MAX_HOT_SIZE, check_int
from hisparse.runtime import streams
from hisparse.runtime.host_ints import IntsLike, int64_cpu
from hisparse.runtime.residency import empty_residency, reset_residency
from hisparse.runtime.state_rows import StateRowAllocator
from hisparse.runtime.views import BindingError

__all__ = [
    "HiSparseIndexGroup",
    "HiSparseRuntime",
    "StateRowAllocator",  # lives in hisparse.runtime.state_rows; importable from here as before
    "empty_residency",
    "reset_residency",
]


class HiSparseIndexGroup:
    """Residency state shared by one leader layer and the followers that reuse its top-k."""

    def __init__(
        self,
        name: str,
        *,
        num_state_rows: int,
        hot_size: int,
        top_k: int,
        max_batch: int,
        num_keys: int,
        device: Union[str, torch.device],
        hot_base: int = 0,
    ) -> None:
        S = check_int("num_state_rows", num_state_rows, 1)
        H = check_int("hot_size", hot_size, 1)
        K = check_int("top_k", top_k, 1)
        if not K <= H <= MAX_HOT_SIZE:
            raise ValueError(
                f"need top_k <= hot_size <= {MAX_HOT_SIZE}, got top_k={K} hot_size={H}"
            )
        check_int("max_batch", max_batch, 1)
        check_int("num_keys", num_keys, 0, INT32_MAX)
        check_int("hot_base", hot_base, 0)
        if hot_base + S * H > INT32_MAX:
            raise ValueError(
                f"hot_base + num_state_rows*hot_size must fit int32, got {hot_base + S * H}"
            )
        self.name = name
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_state_rows, self.hot_size, self.top_k = S, H, K
        self.max_batch, self.num_keys, self.hot_base = max_batch, num_keys, hot_base
        dev = self.device
        self.slot_keys, self.lru = empty_residency(S, H, dev)
        self.counters = torch.zeros(3, dtype=torch.uint64, device=dev)
        self.stats = self.counters[0:2]
        self.moved_bytes = self.counters[2:3]
        on_cuda = dev.type == "cuda"
        self.counters_host = torch.zeros(3, dtype=torch.uint64, pin_memory=on_cuda)
        self.out_rows = torch.full((max_batch, K), -1, dtype=torch.int32, device=dev)
        self.miss_src = torch.zeros((max_batch, K), dtype=torch.int32, device=dev)
        self.miss_dst = torch.zeros((max_batch, K), dtype=torch.int32, device=dev)
        self.miss_count = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.copy_stream = torch.cuda.Stream(device=dev) if on_cuda else None
        self._resolved = torch.cuda.Event() if on_cuda else None
        # one event per ordering, recorded again each time (streams.wait_for)
        self._copied = torch.cuda.Event() if on_cuda else None  # copy stream -> compute
        self.computed = torch.cuda.Event() if on_cuda else None  # compute -> copy stream
        self.members: list = []
        self.stats_row_bytes = 0
        self.batch = 0
        # Bound once: every argument the runtime owns was checked above, so each step calls the
        # ops without the per-call checks of ``hisparse.ops`` (host time on the decode path).
        self._resolve_op = ops.bound_op("hisparse_resolve_residency", self.device.type)
        self._gather_op = ops.bound_op("hisparse_gather", self.device.type)
        self.save_op = ops.bound_op("hisparse_save_rows", self.device.type)  # the connector's
        self._views: dict = {}  # batch size -> (out_rows, miss_src, miss_dst, miss_count)

    @property
    def leader(self) -> Optional["HiSparseRuntime"]:
        return self.members[0] if self.members else None

    def resolve(
        self,
        top_k: torch.Tensor,
        state_rows: torch.Tensor,
        resident_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Resolve one step for the batch; returns the physical rows attention reads [B, K]."""
        if top_k.dim() != 2 or top_k.shape[1] != self.top_k:
            raise ValueError(f"top_k must have shape [B, {self.top_k}], got {tuple(top_k.shape)}")
        B = top_k.shape[0]
        if B > self.max_batch:
            raise ValueError(f"batch {B} exceeds max_batch {self.max_batch} of group {self.name!r}")
        if self.copy_stream is not None and not torch.cuda.is_current_stream_capturing():
            # The previous step's gathers read the plan buffers this resolve overwrites.
            streams.wait_for(streams.current(self.device), self.copy_stream, self._copied)
        out, src, dst, count = self._batch_views(B)
        self._resolve_op(
            top_k,
            state_rows,
            resident_rows,
            self.slot_keys,
            self.lru,
            self.stats,
            out,
            src,
            dst,
            count,
            self.num_keys,
            self.hot_base,
        )
        if self._resolved is not None:
            self._resolved.record(streams.current(self.device))
        self.batch = B
        return out

    def _batch_views(self, B: int) -> tuple:
        """The plan buffers' first ``B`` rows (made once per batch size)."""
        views = self._views.get(B)
        if views is None:
            bufs = (self.out_rows, self.miss_src, self.miss_dst, self.miss_count)
            views = self._views[B] = tuple(t[:B] for t in bufs)
        return views

    def plan(self) -> tuple:
        """The last resolve's miss plan: (miss_src, miss_dst, miss_count) for its batch."""
        return self._batch_views(self.batch)[1:]

    def reset_hot_state(self) -> None:
        """Empty every state row and reset the LRU order. The counters are kept: they are
        cumulative telemetry that only a snapshot drains, and zeroing counts no snapshot has
        reported yet would make Prometheus counters lose them."""
        reset_residency(self.slot_keys, self.lru)

    def _rows_tensor(self, name: str, rows: IntsLike) -> torch.Tensor:
        t = int64_cpu(name, rows)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_state_rows):
            raise ValueError(f"{name} must lie in [0, {self.num_state_rows}), got {t.tolist()}")
        return self._upload(t)

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """int32 copy on the device without blocking the host (pinned staging on CUDA)."""
        t = t.to(torch.int32)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def release(self, state_rows: IntsLike) -> None:
        """Reset the listed state rows: their request finished or they are handed to a new one."""
        rows = self._rows_tensor("state_rows", state_rows)
        if rows.numel():
            ops.invalidate(self.slot_keys, self.lru, rows)

    def invalidate_keys(self, state_rows: IntsLike, keys: IntsLike) -> None:
        """Drop hot copies of keys whose KV was rewritten (keys[i] on state_rows[i])."""
        rows = self._rows_tensor("state_rows", state_rows)
        k = int64_cpu("keys", keys)
        if k.numel() != rows.numel():
            raise ValueError(
                f"keys must match state_rows in length, got {k.numel()} and {rows.numel()}"
            )
        # The op takes int32 keys: a key past int32 would wrap onto another key (2**32 + 1 -> 1)
        # and drop that key's hot copy while the rewritten one stays stale.
        bad = (k < 0) | (k >= self.num_keys)
        if bool(bad.any()):
            raise ValueError(
                f"keys must lie in [0, num_keys={self.num_keys}), got {int(k[bad][0])} at index "
                f"{int(bad.nonzero()[0])}"
            )
        if rows.numel():
            ops.invalidate(self.slot_keys, self.lru, rows, self._upload(k))


class HiSparseRuntime:
    """One layer: its host view (full KV) and its hot view (where attention reads)."""

    def __init__(
        self,
        layer_name: str,
        index_group: HiSparseIndexGroup,
        host_view: torch.Tensor,
        hot_view: torch.Tensor,
    ) -> None:
        g = index_group
        for what, v in (("host_view", host_view), ("hot_view", hot_view)):
            if v.dtype != torch.uint8 or v.dim() not in (2, 3):
                raise BindingError(
                    f"{layer_name}: {what} must be uint8 [rows, row_bytes] or "
                    "[blocks, block_size, row_bytes]"
                )
        rows = lambda v: v.shape[0] * (v.shape[1] if v.dim() == 3 else 1)  # noqa: E731
        if host_view.shape[-1] != hot_view.shape[-1]:
            raise BindingError(
                f"{layer_name}: host and hot rows differ in size ({host_view.shape[-1]} vs "
                f"{hot_view.shape[-1]} bytes)"
            )
        if rows(host_view) < g.num_keys:
            raise BindingError(
                f"{layer_name}: host view has {rows(host_view)} rows, group needs {g.num_keys}"
            )
        if rows(hot_view) < g.hot_base + g.num_state_rows * g.hot_size:
            raise BindingError(
                f"{layer_name}: hot view has {rows(hot_view)} rows, group needs "
                f"{g.hot_base + g.num_state_rows * g.hot_size}"
            )
        if hot_view.device != g.device:
            raise BindingError(
                f"{layer_name}: hot view is on {hot_view.device}, group on {g.device}"
            )
        if members := g.members:
            if rows(host_view) != rows(members[0].host_view):
                raise BindingError(f"{layer_name}: host view rows differ from the group leader's")
        self.layer_name = layer_name
        self.index_group = g
        self.host_view = host_view
        self.hot_view = hot_view
        self.row_bytes = int(host_view.shape[-1])
        self._host_list, self._hot_list = [host_view], [hot_view]
        # The host view as [rows, row_bytes], the shape saves index into.
        self.host_rows_view = host_view.reshape(-1, self.row_bytes)
        self.ready = torch.cuda.Event() if g.copy_stream is not None else None
        g.members.append(self)
        g.stats_row_bytes += self.row_bytes

    @property
    def is_leader(self) -> bool:
        return self.index_group.leader is self

    def resolve(self, top_k, state_rows, resident_rows=None) -> torch.Tensor:
        if not self.is_leader:
            raise RuntimeError(f"{self.layer_name} is a follower; only the leader resolves")
        return self.index_group.resolve(top_k, state_rows, resident_rows)

    def gather(self, copy: Optional[Callable] = None) -> None:
        """Copy this step's misses host -> hot for this layer (copy stream on CUDA). ``copy``,
        called as copy(host_view, hot_view, miss_src, miss_dst, miss_count), replaces the op's
        gather; the moved bytes are counted either way."""
        g = self.index_group
        plan = g.plan()

        def run() -> None:
            if copy is None:
                g._gather_op(self._host_list, self._hot_list, *plan, g.moved_bytes)
                return
            copy(self.host_view, self.hot_view, *plan)
            # As the op counts them: the plan's rows times this member's row bytes (the counter
            # is uint64; int64 arithmetic on the same bits, exact below 2**63).
            g.moved_bytes.view(torch.int64).add_(plan[2].sum(), alpha=self.row_bytes)

        if g.copy_stream is None:
            run()
            return
        g.copy_stream.wait_event(g._resolved)
        with streams.on_stream(g.copy_stream):
            run()
            self.ready.record(g.copy_stream)

    def wait_ready(self) -> None:
        """Make the current stream wait for this layer's copies (no-op on CPU)."""
        if self.ready is not None:
            streams.current(self.index_group.device).wait_event(self.ready)

    def reset_hot_state(self) -> None:
        self.index_group.reset_hot_state()
