"""The worker side of the HiSparse connector: one object per worker (TP rank) that composes
binding/allocation (``registration``), per-step driving (``step_driver``, with ``host_save`` for
the host writes) and the counter sampler (``sampler``), all in ``hisparse.connector``.

``HiSparseConnectorWorker`` is built from a validated ``HiSparseConfig``; ``register_kv_caches``
then allocates the (pinned) host pool, binds every layer's host view and hot view, and builds the
index groups. See docs/connector.md for the per-step API and docs/telemetry.md for the two-phase,
event-gated sampling of ``get_kv_connector_stats``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from hisparse import ops
from hisparse.connector.config import HiSparseConfig
from hisparse.connector.host_save import SlotMapping, save_kv_rows
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.registration import register
from hisparse.connector.sampler import CounterSampler, DeviceHooks
from hisparse.connector.stats import HiSparseKVConnectorStats
from hisparse.connector.step_driver import StepDriver
from hisparse.connector.tp_pool import shared_steps
from hisparse.runtime import HiSparseRuntime
from hisparse.runtime.host_pool import HostPool

__all__ = ["HiSparseConnectorMetadata", "HiSparseConnectorWorker"]


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
        # What register_kv_caches binds (hisparse.connector.registration), fixed until shutdown.
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
        self._step: Optional[StepDriver] = None
        self._shared = None  # tp_pool.SharedSteps when the TP ranks share the host pool
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
        peers: Any = None,
    ) -> None:
        """Bind every layer: its registered buffer (attention rows, hot buffers at the end) and a
        host view in a freshly allocated host pool; build index groups of ``index_share`` layers
        (or the explicit ``groups``, leader first). ``host_rows``: the key space (e.g. vLLM's
        slots); by default as many whole blocks as ``host_pool_gib`` holds. ``peers``: the TP
        group, whose ranks may share one host pool (``hisparse.connector.tp_pool``)."""
        self._check_alive()
        if self.registered:
            raise RuntimeError("register_kv_caches was already called on this worker")
        reg = register(self.config, kv_caches, host_rows=host_rows, groups=groups, peers=peers)
        self._shared = shared_steps(reg.fence, reg.layer_names, reg.groups)
        self.device = reg.device
        self.layer_names = reg.layer_names
        self.host_pool = reg.host_pool
        self.host_rows = reg.host_rows
        self.hot_base = reg.hot_base
        self.groups = reg.groups
        self.runtimes = reg.runtimes
        self._step = step = StepDriver(self.config, reg)
        self.sampler = CounterSampler(
            reg.groups,
            self.config.metrics_interval,
            self._hooks or DeviceHooks.for_device(reg.device),
            usage=lambda: step.host_rows_in_use / reg.host_rows if reg.host_rows else 0.0,
            seconds=self.config.metrics_seconds,
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

    def load_host_rows(self, layer_name: str, keys: torch.Tensor) -> torch.Tensor:
        """The layer's host rows ``keys`` (int [n]; -1 is padding and reads row 0) as uint8
        [n, row_bytes] on the compute device: what a prefill attends over (its own rows and the
        earlier chunks' or prefix-cache hits'). On CUDA one gather from the pinned pool, ordered
        after this step's saves (the copy stream) with no host sync; the caller bounds n."""
        rt = self.runtime(layer_name)
        view = rt.host_view.reshape(-1, rt.row_bytes)
        flat = keys.reshape(-1).clamp(min=0)
        if self.device.type == "cpu":
            return view[flat]
        n = flat.numel()
        out = torch.empty(n, rt.row_bytes, dtype=torch.uint8, device=self.device)
        if n == 0:
            return out
        stream = rt.index_group.copy_stream
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        count = torch.full((1,), n, dtype=torch.int32, device=self.device)
        dst = torch.arange(n, dtype=torch.int32, device=self.device)
        ops.gather([view], [out], flat.to(torch.int32).view(1, n), dst.view(1, n), count)
        return out

    def batch_state_rows(self, anchor_keys: torch.Tensor) -> torch.Tensor:
        """The state row of each batch row, found by the key of the row's last token this step
        (the ``anchors`` of the step's metadata): device int32 [B].

        On the CPU, requests that share an anchor (identical prompts recomputing the same cached
        token in one step) get their rows in turn, and a row that belongs to no scheduled request
        is an error. On CUDA the lookup is a device table (no host sync): such rows stay -1
        (padding) and a shared anchor maps to one state row."""
        self._check_registered()
        return self._step.batch_state_rows(anchor_keys)

    @property
    def state_rows(self) -> torch.Tensor:
        """This step's state row of each batch row (device int32 [max_num_seqs], -1 padding)."""
        self._check_registered()
        return self._step.state_rows

    # ------------------------------------------------------------- per step
    def start_step(self, meta: HiSparseConnectorMetadata) -> None:
        """Apply the scheduler's metadata: reset rows, drop rewritten keys, set state rows."""
        self._check_registered()
        if self._shared is not None:
            self._shared.start()
        self._step.start(meta)

    def next_pass(self) -> None:
        """A further forward of this step (a speculative draft's later pass): every index group
        may resolve once more."""
        self._check_registered()
        self._step.next_pass()

    def end_step(self) -> None:
        """The step is over (``clear_connector_metadata``): resolving again needs a new
        ``start_step``."""
        if self._step is not None:
            self._step.end()
        if self._shared is not None:
            self._shared.end()

    def resolve(
        self,
        layer_name: str,
        top_k: Optional[torch.Tensor],
        resident_rows: Optional[torch.Tensor] = None,
        *,
        state_rows: Optional[torch.Tensor] = None,
        defer_misses: bool = False,
    ) -> torch.Tensor:
        """Leader: resolve residency for the batch (once per step). Every layer (leader or
        follower) then gathers the group's plan into its own hot rows, here, after its own
        `save_kv_layer` of this step: gathering a follower earlier would copy rows it has not
        written yet and cache them as hits. Returns the attention rows [B, top_k]; a follower
        gets the leader's result. ``state_rows``: the batch rows' state rows (device int32 [B],
        e.g. from ``batch_state_rows``); by default the metadata's order. ``defer_misses``:
        no gather; the layer's row read fetches the misses by ``miss_plan(layer_name)``."""
        rt = self.runtime(layer_name)
        return self._step.resolve(rt, top_k, resident_rows, state_rows, defer_misses)

    def miss_plan(self, layer_name: str):
        """See ``HiSparseConnectorImpl.miss_plan``."""
        self.runtime(layer_name)  # an unknown name is refused by name
        return self._step.miss_plan(layer_name)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The current stream waits for this layer's copies (no-op on CPU)."""
        self.runtime(layer_name).wait_ready()

    def save_kv_layer(
        self, layer_name: str, kv_rows: torch.Tensor, slot_mapping: SlotMapping
    ) -> None:
        """Write this step's new KV rows of one layer into the host pool at their slots (keys).
        Slots < 0 are padding and skipped. ``slot_mapping``: a list, a CPU tensor, or (CUDA) a
        tensor on the rows' device, which is used there without a host sync. With a host pool
        shared by the TP ranks only rank 0 writes; the others wait here until it has."""
        rt = self.runtime(layer_name)
        if self._shared is None:
            save_kv_rows(rt, kv_rows, slot_mapping, self.host_rows)
            return
        self._shared.save(
            layer_name,
            lambda: save_kv_rows(rt, kv_rows, slot_mapping, self.host_rows),
            rt.index_group,
        )

    # ------------------------------------------------------------ telemetry
    def get_kv_connector_stats(self) -> Optional[HiSparseKVConnectorStats]:
        """Call once per engine step: the two-phase, event-gated counter snapshot (see
        ``hisparse.connector.sampler``). Never synchronises the host with the device."""
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
            if self._shared is not None:
                self._shared.close()
            if self.host_pool is not None:
                self.host_pool.release()
        self._shut_down = True
        self.runtimes = {}
        self.groups = []
        self.host_pool = None
        self._step = None
        self._shared = None
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
