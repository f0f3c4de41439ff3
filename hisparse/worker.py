"""The worker side of the HiSparse connector: runtimes, host pool, per-step driving, telemetry.

``HiSparseConnectorWorker`` is built from a validated ``HiSparseConfig``; ``register_kv_caches``
then allocates the (pinned) host pool, binds every layer's host view and hot view, and builds the
index groups. See docs/connector.md for the per-step API and docs/telemetry.md for the two-phase,
event-gated sampling of ``get_kv_connector_stats``.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from hisparse import ops
from hisparse.binding import BindingError, PackedLayout, bind_layers, check_disjoint
from hisparse.config import HiSparseConfig, HiSparseConfigError
from hisparse.host_pool import HostPool
from hisparse.limits import ROW_ALIGN
from hisparse.metadata import HiSparseConnectorMetadata
from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime
from hisparse.sampler import CounterSampler, DeviceHooks
from hisparse.stats import HiSparseKVConnectorStats


def _as_row_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a uint8 [rows, row_bytes] view (row_bytes = last-dim bytes)."""
    if not isinstance(t, torch.Tensor):
        raise BindingError(f"kv cache of layer {name!r} must be a tensor, got {type(t).__name__}")
    if t.dim() < 1 or t.numel() == 0:
        raise BindingError(f"kv cache of layer {name!r} is empty or 0-d")
    if not t.is_contiguous():
        raise BindingError(f"kv cache of layer {name!r} must be contiguous")
    row_bytes = t.shape[-1] * t.element_size()
    if row_bytes % ROW_ALIGN or t.data_ptr() % ROW_ALIGN:
        raise BindingError(
            f"kv cache of layer {name!r}: rows must be {ROW_ALIGN}-byte aligned, got row_bytes="
            f"{row_bytes} and data pointer {t.data_ptr():#x}"
        )
    b = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return b.reshape(-1, row_bytes)


class HiSparseConnectorWorker:
    """Owns the host pool, index groups and per-layer runtimes of one worker (TP rank)."""

    def __init__(
        self,
        config: HiSparseConfig,
        *,
        hooks: Optional[DeviceHooks] = None,
    ) -> None:
        """``hooks``: the device plumbing the counter sampler uses (default: the device's own;
        tests pass stand-ins to observe the ordering)."""
        if not isinstance(config, HiSparseConfig):
            raise TypeError(f"config must be a HiSparseConfig, got {type(config).__name__}")
        self.config = config
        self.device: Optional[torch.device] = None
        self.layer_names: tuple = ()
        self.groups: list = []
        self.runtimes: dict = {}
        self.host_pool: Optional[HostPool] = None
        self.host_rows = 0
        self.hot_base = 0
        self.final_stats: Optional[HiSparseKVConnectorStats] = None
        self._hooks = hooks
        self.sampler: Optional[CounterSampler] = None
        self._state_rows: Optional[torch.Tensor] = None
        self._resolved: set = set()
        self._gathered: set = set()
        self._host_rows_in_use = 0
        self._row_of_slot: Optional[torch.Tensor] = None  # state row by anchor key (vLLM)
        self._anchors: Optional[torch.Tensor] = None
        self._anchor_rows: Optional[dict] = None  # key -> [(state row, request id)], step order
        self._shut_down = False

    # ------------------------------------------------------------------ setup
    @property
    def registered(self) -> bool:
        return bool(self.runtimes)

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        host_rows: Optional[int] = None,
        groups: Optional[Sequence[Sequence[str]]] = None,
    ) -> None:
        """Bind every layer: its registered buffer (attention rows, hot buffers at the end) and a
        host view in a freshly allocated host pool; build index groups of ``index_share`` layers
        (or the explicit ``groups``, leader first). ``host_rows``: the key space (e.g. vLLM's
        slots); by default as many whole blocks as ``host_pool_gib`` holds."""
        self._check_alive()
        if self.registered:
            raise RuntimeError("register_kv_caches was already called on this worker")
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty dict {layer_name: tensor}")
        cfg = self.config
        S, H = cfg.max_num_seqs, cfg.device_buffer_size
        names = tuple(kv_caches)
        if groups is None:
            share = cfg.index_share
            groups = [names[i : i + share] for i in range(0, len(names), share)]
        else:
            flat = [n for members in groups for n in members]
            if sorted(flat) != sorted(names) or len(set(flat)) != len(flat):
                raise ValueError(
                    "groups must list every registered layer exactly once, got "
                    f"{[list(m) for m in groups]} for layers {list(names)}"
                )
        views = {n: _as_row_bytes(n, kv_caches[n]) for n in names}
        devices = {v.device for v in views.values()}
        if len(devices) != 1:
            raise BindingError(
                f"kv caches must all be on one device, got {sorted(map(str, devices))}"
            )
        device = devices.pop()
        # Every layer attends through its own rows: two layers sharing bytes would overwrite
        # each other's hot rows (the base-offset binding bug).
        check_disjoint(views)
        pin = cfg.pin_host_pool if cfg.pin_host_pool is not None else device.type == "cuda"
        if pin != (device.type == "cuda"):
            raise HiSparseConfigError(
                f"kv_connector_extra_config['pin_host_pool'] = {cfg.pin_host_pool} does not fit "
                f"kv caches on {device}: the CUDA gather reads the host pool directly, so it is "
                "pinned exactly when the caches are on a CUDA device (leave it unset)"
            )
        for n, v in views.items():
            if v.shape[0] < S * H:
                raise BindingError(
                    f"kv cache of layer {n!r} has {v.shape[0]} rows but the hot buffers need "
                    f"max_num_seqs * device_buffer_size = {S} * {H} = {S * H}"
                )
        rows = {v.shape[0] for v in views.values()}
        if len(rows) != 1:
            raise BindingError(
                f"kv caches must all have the same number of rows, got {sorted(rows)}"
            )
        total_rows = rows.pop()
        hot_base = total_rows - S * H

        # Host pool: the same number of rows for every layer, a whole number of blocks.
        row_bytes = {n: int(views[n].shape[1]) for n in names}
        per_row = sum(row_bytes.values())
        if host_rows is None:
            num_blocks = cfg.host_pool_bytes // (per_row * cfg.block_size)
            if num_blocks < 1:
                raise HiSparseConfigError(
                    f"kv_connector_extra_config['host_pool_gib'] = {cfg.host_pool_gib} is smaller "
                    f"than one block of every layer ({per_row * cfg.block_size} bytes)"
                )
            host_rows = num_blocks * cfg.block_size
            if host_rows > 2**31 - 1:
                num_blocks = (2**31 - 1) // cfg.block_size
                host_rows = num_blocks * cfg.block_size
        else:
            if isinstance(host_rows, bool) or not isinstance(host_rows, int) or host_rows < 1:
                raise ValueError(f"host_rows must be a positive int, got {host_rows!r}")
            if host_rows > 2**31 - 1:
                raise ValueError(f"host_rows = {host_rows} does not fit int32 keys")
            num_blocks = -(-host_rows // cfg.block_size)
            host_rows = num_blocks * cfg.block_size
        pool = HostPool(
            host_rows * per_row,
            pin=pin,
            what="HiSparse host pool (kv_connector_extra_config['host_pool_gib'])",
        )
        host_views: dict = {}
        offset = 0
        for n in names:
            layout = PackedLayout((n,), num_blocks, cfg.block_size, row_bytes[n], offset=offset)
            host_views.update(bind_layers(pool.raw, layout))
            offset = layout.nbytes()  # end of this layer (nbytes includes the offset)
        check_disjoint(host_views)

        group_objs, runtimes = [], {}
        for gi, members in enumerate(groups):
            g = HiSparseIndexGroup(
                f"group{gi}:{members[0]}",
                num_state_rows=S,
                hot_size=H,
                top_k=cfg.top_k,
                max_batch=S,
                num_keys=host_rows,
                device=device,
                hot_base=hot_base,
            )
            for n in members:
                runtimes[n] = HiSparseRuntime(n, g, host_views[n], views[n])
            group_objs.append(g)
        groups = group_objs

        self.device = device
        self.layer_names = names
        self.host_pool = pool
        self.host_rows = host_rows
        self.hot_base = hot_base
        self.groups = groups
        self.runtimes = runtimes
        self._state_rows = torch.full((S,), -1, dtype=torch.int32, device=device)
        self.sampler = CounterSampler(
            groups,
            cfg.metrics_interval,
            self._hooks or DeviceHooks.for_device(device),
            usage=lambda: self._host_rows_in_use / self.host_rows if self.host_rows else 0.0,
        )

    # -------------------------------------------------------------- accessors
    def runtime(self, layer_name: str) -> HiSparseRuntime:
        self._check_alive()
        try:
            return self.runtimes[layer_name]
        except KeyError:
            raise ValueError(
                f"layer_name {layer_name!r} is not a registered HiSparse layer "
                f"(registered: {', '.join(self.layer_names) or 'none'})"
            ) from None

    def host_view(self, layer_name: str) -> torch.Tensor:
        """The layer's host rows, uint8 [host_rows, row_bytes] (row = key = slot)."""
        rt = self.runtime(layer_name)
        return rt.host_view.reshape(-1, rt.row_bytes)

    def hot_view(self, layer_name: str) -> torch.Tensor:
        """The layer's attention rows, uint8 [rows, row_bytes] (hot buffers from ``hot_base``)."""
        return self.runtime(layer_name).hot_view

    def batch_state_rows(self, anchor_keys: torch.Tensor) -> torch.Tensor:
        """The state row of each batch row, found by the key of the row's last token this step
        (the ``anchors`` of the step's metadata): device int32 [B].

        On the CPU, requests that share an anchor (identical prompts recomputing the same cached
        token in one step) get their rows in turn, and a row that belongs to no scheduled request
        is an error. On CUDA the lookup is a device table (no host sync): such rows stay -1
        (padding) and a shared anchor maps to one state row."""
        self._check_registered()
        if self._anchor_rows is None:
            raise RuntimeError(
                "batch_state_rows needs step metadata with anchors "
                "(the scheduler side of this connector sends them)"
            )
        if not isinstance(anchor_keys, torch.Tensor) or anchor_keys.dim() != 1:
            raise ValueError("anchor_keys must be a 1-D tensor of keys")
        if self.device.type != "cpu":
            keys = anchor_keys.to(self.device, torch.long)
            return self._row_of_slot[keys.clamp(0, self.host_rows - 1)]
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

    @property
    def state_rows(self) -> torch.Tensor:
        """This step's state row of each batch row (device int32 [max_num_seqs], -1 padding)."""
        self._check_registered()
        return self._state_rows

    # ------------------------------------------------------------- per step
    def start_step(self, meta: HiSparseConnectorMetadata) -> None:
        """Apply the scheduler's metadata: reset rows, drop rewritten keys, set state rows."""
        self._check_registered()
        if not isinstance(meta, HiSparseConnectorMetadata):
            raise TypeError(
                f"metadata must be HiSparseConnectorMetadata, got {type(meta).__name__}"
            )
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
        if len(set(meta.state_rows)) != B:
            raise ValueError(f"state_rows of one step must be distinct, got {meta.state_rows}")
        if meta.host_rows_in_use > self.host_rows:
            raise ValueError(
                f"live requests hold {meta.host_rows_in_use} tokens but the host pool has "
                f"{self.host_rows} rows: raise kv_connector_extra_config['host_pool_gib'] "
                "or admit fewer requests"
            )
        if meta.reset_rows:
            for g in self.groups:
                g.release(list(meta.reset_rows))
        if meta.invalidate:
            rows = [int(r) for r, _ in meta.invalidate]
            keys = [int(k) for _, k in meta.invalidate]
            for g in self.groups:
                g.invalidate_keys(rows, keys)
        self._check_all_gathered()
        padded = list(meta.state_rows) + [-1] * (S - B)
        self._state_rows.copy_(self._upload(padded))
        if meta.anchors:
            self._set_anchors(meta)
        self._resolved.clear()
        self._gathered.clear()
        self._host_rows_in_use = max(0, int(meta.host_rows_in_use))

    def _upload(self, values: list) -> torch.Tensor:
        src = torch.tensor(values, dtype=torch.int32)
        if self.device.type == "cuda":
            # From the caching host allocator: the block is not reused before the copy is done.
            return src.pin_memory().to(self.device, non_blocking=True)
        return src

    def _set_anchors(self, meta: HiSparseConnectorMetadata) -> None:
        keys = [int(k) for k in meta.anchors]
        bad = [(r, k) for r, k in zip(meta.req_ids, keys) if not 0 <= k < self.host_rows]
        if bad:
            raise ValueError(
                f"request {bad[0][0]!r}: anchor key {bad[0][1]} lies outside the "
                f"host pool's {self.host_rows} rows"
            )
        self._anchor_rows = {}
        for k, row, rid in zip(keys, meta.state_rows, meta.req_ids):
            self._anchor_rows.setdefault(k, []).append((row, rid))
        if self.device.type == "cpu":
            return
        if self._row_of_slot is None:
            self._row_of_slot = torch.full(
                (self.host_rows,), -1, dtype=torch.int32, device=self.device
            )
        elif self._anchors is not None:
            self._row_of_slot[self._anchors] = -1
        idx = self._upload(keys).long()
        self._row_of_slot[idx] = self._upload(list(meta.state_rows))
        self._anchors = idx

    def _check_all_gathered(self) -> None:
        """Every member of a group that resolved last step must have gathered: the shared slot
        table already names the keys, so a member that skipped its copy would serve stale rows
        later. Its group's hot state is dropped (nothing stale is ever read) and it is an error."""
        for g in self.groups:
            if g.name not in self._resolved:
                continue
            skipped = [m.layer_name for m in g.members if m.layer_name not in self._gathered]
            if skipped:
                g.release(list(range(g.num_state_rows)))
                self._resolved.clear()
                raise RuntimeError(
                    f"layer {skipped[0]!r} did not gather (resolve) in the step its leader "
                    f"{g.leader.layer_name!r} resolved; its group's hot buffers were reset"
                )

    def resolve(
        self,
        layer_name: str,
        top_k: Optional[torch.Tensor],
        resident_rows: Optional[torch.Tensor] = None,
        *,
        state_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Leader: resolve residency for the batch (once per step). Every layer (leader or
        follower) then gathers the group's plan into its own hot rows, here, after its own
        `save_kv_layer` of this step: gathering a follower earlier would copy rows it has not
        written yet and cache them as hits. Returns the attention rows [B, top_k]; a follower
        gets the leader's result. ``state_rows``: the batch rows' state rows (device int32 [B],
        e.g. from ``batch_state_rows``); by default the metadata's order."""
        rt = self.runtime(layer_name)
        g = rt.index_group
        if rt.is_leader:
            if not isinstance(top_k, torch.Tensor) or top_k.dim() != 2:
                raise ValueError(f"top_k must be a 2-D int32 tensor [B, {self.config.top_k}]")
            if g.name in self._resolved:
                raise RuntimeError(
                    f"layer {layer_name!r} already resolved this step: a second plan would "
                    "replace the one its member layers have not gathered yet"
                )
            n = top_k.shape[0]
            if n > self.config.max_num_seqs:
                raise ValueError(
                    f"top_k has {n} rows, more than max_num_seqs = {self.config.max_num_seqs}"
                )
            if state_rows is None:
                state_rows = self._state_rows[:n]
            elif state_rows.shape != (n,):
                raise ValueError(
                    f"state_rows must have shape ({n},) like top_k's rows, got "
                    f"{tuple(state_rows.shape)}"
                )
            g.resolve(top_k, state_rows, resident_rows)
            self._resolved.add(g.name)
            self._gathered.difference_update(m.layer_name for m in g.members)
        elif g.name not in self._resolved:
            raise RuntimeError(
                f"layer {layer_name!r} follows {g.leader.layer_name!r}, which has not resolved "
                "this step"
            )
        if layer_name not in self._gathered:  # a second call must not copy (or count) again
            rt.gather()
            self._gathered.add(layer_name)
        return g.out_rows[: g.batch]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The current stream waits for this layer's copies (no-op on CPU)."""
        self.runtime(layer_name).wait_ready()

    def save_kv_layer(
        self,
        layer_name: str,
        kv_rows: torch.Tensor,
        slot_mapping: "Sequence[int] | torch.Tensor",
    ) -> None:
        """Write this step's new KV rows of one layer into the host pool at their slots (keys).
        Slots < 0 are padding and skipped. ``slot_mapping``: a list, a CPU tensor, or (CUDA) a
        tensor on the rows' device, which is used there without a host sync."""
        rt = self.runtime(layer_name)
        if not isinstance(kv_rows, torch.Tensor):
            raise ValueError(f"kv_layer must be a tensor, got {type(kv_rows).__name__}")
        if isinstance(slot_mapping, torch.Tensor):
            if slot_mapping.device.type not in ("cpu", kv_rows.device.type) or (
                slot_mapping.device.type != "cpu" and slot_mapping.device != kv_rows.device
            ):
                raise ValueError(
                    f"slot_mapping is on {slot_mapping.device}; it must be on the "
                    f"CPU or on the rows' device {kv_rows.device}"
                )
            slots = slot_mapping.reshape(-1).to(torch.int64)
        else:
            slots = torch.as_tensor(list(slot_mapping), dtype=torch.int64)
        if not kv_rows.is_contiguous():
            kv_rows = kv_rows.contiguous()
        b = kv_rows.view(torch.uint8) if kv_rows.dtype != torch.uint8 else kv_rows
        if b.numel() % rt.row_bytes:
            raise ValueError(
                f"kv_layer of {layer_name!r} is not a whole number of {rt.row_bytes}-byte rows"
            )
        rows = b.reshape(-1, rt.row_bytes)
        if rows.shape[0] != slots.numel():
            raise ValueError(
                f"kv_layer of {layer_name!r} has {rows.shape[0]} rows but slot_mapping has "
                f"{slots.numel()} entries"
            )
        if slots.device.type == "cpu" and slots.numel() and int(slots.max()) >= self.host_rows:
            raise ValueError(
                f"slot_mapping of {layer_name!r} holds slot {int(slots.max())}, outside the host "
                f"pool's {self.host_rows} rows: raise kv_connector_extra_config['host_pool_gib']"
            )
        if rows.device.type == "cpu":
            keep = slots >= 0  # padding slots are skipped
            if not bool(keep.all()):
                rows, slots = rows[keep], slots[keep]
            if slots.numel():
                self.host_view(layer_name).index_copy_(0, slots, rows)
            return
        if not slots.numel():
            return
        # CUDA: one launch on the group's copy stream, after the compute that produced the rows
        # (later gathers run on that stream too); the kernel writes pinned host rows directly.
        dev = rows.device
        if slots.device.type == "cpu":
            slots = slots.to(torch.int32).pin_memory().to(dev, non_blocking=True)
        else:
            slots = slots.to(torch.int32)
        src = torch.arange(rows.shape[0], dtype=torch.int32, device=dev)
        stream = rt.index_group.copy_stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            ops.save_rows([rows], [rt.host_view], src, slots)
        for t in (rows, slots, src):
            t.record_stream(stream)

    # ------------------------------------------------------------ telemetry
    def get_kv_connector_stats(self) -> Optional[HiSparseKVConnectorStats]:
        """Call once per engine step: the two-phase, event-gated counter snapshot (see
        ``hisparse.sampler``). Never synchronises the host with the device."""
        if not self.registered or self._shut_down:
            return None
        return self.sampler.step()

    def drain_stats(self) -> Optional[HiSparseKVConnectorStats]:
        """Blocking: collect the pending snapshot and everything counted since. For the end of a
        run, shutdown and tests; never on the decode path."""
        if not self.registered or self._shut_down:
            return None
        return self.sampler.drain()

    # ------------------------------------------------------------- shutdown
    def shutdown(self) -> Optional[HiSparseKVConnectorStats]:
        """Drain outstanding counters into ``final_stats``, wait for in-flight copies, release the
        host pool and hot state. A second call does nothing."""
        if self._shut_down:
            return self.final_stats
        if self.registered:
            self.final_stats = self.drain_stats()
            for g in self.groups:
                if g.copy_stream is not None:
                    g.copy_stream.synchronize()
            if self.host_pool is not None:
                self.host_pool.release()
        self._shut_down = True
        self.runtimes = {}
        self.groups = []
        self.host_pool = None
        self._state_rows = None
        self.sampler = None
        return self.final_stats

    @property
    def is_shut_down(self) -> bool:
        return self._shut_down

    def _check_alive(self) -> None:
        if self._shut_down:
            raise RuntimeError("this HiSparse worker has been shut down")

    def _check_registered(self) -> None:
        self._check_alive()
        if not self.registered:
            raise RuntimeError("register_kv_caches must be called before stepping the worker")
