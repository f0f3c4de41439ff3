"""``HiSparseConnector``: HiSparse on vLLM's KV-connector contract.

Loaded by vLLM with ``kv_connector_module_path="hisparse.connector"`` and
``kv_connector="HiSparseConnector"`` (hisparse's plugin keeps vLLM's config layer from taking
that name for its in-tree connector, ``hisparse.vllm.patches``) or ``"HiSparseOOTConnector"``;
driven the same way by hisparse's reference engine. See docs/connector.md and
docs/vllm.md. Importing this module imports vLLM's base classes when vLLM is installed
(never ``import hisparse`` itself).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping, Optional

import torch

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.lifecycle import (
    SLEEP_MODE_REFUSAL,
    Preemptions,
    connector_role,
    request_id,
)
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.scheduler import HiSparseScheduler, StepSchedule
from hisparse.connector.stats import HiSparseKVConnectorStats, HiSparsePromMetrics
from hisparse.connector.worker import HiSparseConnectorWorker
from hisparse.vllm.compat import (
    HAVE_VLLM,
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    engine_defaults,
    tensor_parallel_peers,
)

__all__ = [
    "HAVE_VLLM",
    "HiSparseConnector",
    "HiSparseConnectorMetadata",
    "HiSparseConnectorWorker",
    "HiSparseOOTConnector",
    "KVConnectorRole",
    "StepSchedule",
]


class HiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    """HiSparse hot-buffering as a KV connector: nothing is loaded from outside; the worker role
    keeps the full KV in a pinned host pool and each request's selected rows in hot buffers."""

    def __init__(
        self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *, device_hooks=None
    ) -> None:
        """``device_hooks``: stand-ins for the worker's stream/event/capture plumbing
        (``hisparse.connector.sampler.DeviceHooks``), for tests; vLLM never passes them."""
        role = connector_role(role, KVConnectorRole)
        super().__init__(vllm_config, role, kv_cache_config)
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None)
        # Inside a vLLM engine the worker is built after the model is loaded: the model's own
        # layers must call us, and a model without HiSparse layers is refused first, at start-up.
        layers = None
        in_engine = getattr(vllm_config, "model_config", None) is not None
        if in_engine and role == KVConnectorRole.WORKER:
            from hisparse.vllm.model_check import model_hisparse_layers

            layers = model_hisparse_layers(vllm_config)
        self.config = HiSparseConfig.from_extra_config(engine_defaults(vllm_config, extra))
        self.worker: Optional[HiSparseConnectorWorker] = None
        self._scheduler: Optional[HiSparseScheduler] = None
        self._model_layers = None
        if layers is not None:
            from hisparse.vllm.model_check import find_model_layers

            self._model_layers = find_model_layers(
                vllm_config, kv_cache_config, self.config, extra, layers
            )
        if role == KVConnectorRole.WORKER:
            self.worker = HiSparseConnectorWorker(self.config, hooks=device_hooks)
        else:
            self._scheduler = HiSparseScheduler(self.config)
            self._preemptions = Preemptions()
            blocks = getattr(kv_cache_config, "num_blocks", None)
            if isinstance(blocks, int) and blocks > 0:
                self._scheduler.host_rows = blocks * self.config.block_size

    @classmethod
    def from_extra_config(
        cls,
        extra_config: Optional[Mapping] = None,
        role: Any = "worker",
        *,
        device_hooks=None,
        host_rows: Optional[int] = None,
    ) -> "HiSparseConnector":
        """Build without a vLLM config (reference engine, tests). ``host_rows`` (scheduler role):
        the worker's host-pool rows (``worker.host_rows``), which vLLM otherwise gives through
        its KV blocks; with it keys and token counts past the pool are refused at the
        scheduler, where they enter."""
        kv = SimpleNamespace(
            kv_connector="HiSparseConnector",
            kv_connector_module_path="hisparse.connector.facade",
            kv_role="kv_both",
            # Handed on as given: HiSparseConfig names a non-mapping (a string, a list of
            # pairs) instead of dict() silently accepting pairs.
            kv_connector_extra_config=extra_config,
            is_kv_producer=False,
            is_kv_consumer=False,
            engine_id=None,
        )
        conn = cls(SimpleNamespace(kv_transfer_config=kv), role, None, device_hooks=device_hooks)
        if host_rows is not None:
            conn._need_scheduler("from_extra_config(host_rows=...)").set_host_rows(host_rows)
        return conn

    # ----------------------------------------------------------- worker side
    def _need_worker(self, what: str) -> HiSparseConnectorWorker:
        if self.worker is None:
            raise RuntimeError(
                f"{what} is a worker-side call; this connector has the scheduler role"
            )
        return self.worker

    def register_kv_caches(self, kv_caches: dict) -> None:
        """From an engine that hands over its hot buffers (the reference engine): bind them. From
        vLLM (its own paged caches): leave those alone; allocate hot buffers for the model's
        HiSparse layers and a host pool backing every vLLM slot."""
        worker = self._need_worker("register_kv_caches")
        if self._model_layers is None:
            worker.register_kv_caches(kv_caches)
            return
        lay = self._model_layers
        S, H = self.config.max_num_seqs, self.config.device_buffer_size
        device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        hot = {
            n: torch.zeros(S * H, rb, dtype=torch.uint8, device=device)
            for n, rb in lay.row_bytes.items()
        }
        # The TP ranks of one host share one host pool where they can (connector/tp_pool.py).
        peers = tensor_parallel_peers()
        worker.register_kv_caches(hot, host_rows=lay.host_rows, groups=lay.groups, peers=peers)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Apply this step's metadata (reset/invalidate state rows, set the batch's state rows).
        HiSparse loads nothing from outside: the per-layer loads are the gathers ``resolve``
        launches."""
        worker = self._need_worker("start_load_kv")
        if not self.has_connector_metadata():
            raise RuntimeError("start_load_kv needs bind_connector_metadata(...) first")
        worker.start_step(self._get_connector_metadata())

    def resolve(
        self, layer_name: str, top_k: Any, resident_rows: Any = None, *, state_rows: Any = None
    ):
        """After the indexer: the attention rows of ``layer_name`` for this step's top-k (rows of
        ``hot_rows(layer_name)``). Followers pass ``top_k=None`` and get the leader's plan."""
        return self._need_worker("resolve").resolve(
            layer_name, top_k, resident_rows, state_rows=state_rows
        )

    def batch_state_rows(self, anchor_keys: Any):
        """The state row of each batch row, from the key of its last token this step."""
        return self._need_worker("batch_state_rows").batch_state_rows(anchor_keys)

    def host_rows(self, layer_name: str):
        """The layer's host-pool rows, uint8 [keys, row_bytes] (row = key)."""
        return self._need_worker("host_rows").host_view(layer_name)

    def hot_rows(self, layer_name: str):
        """The rows ``resolve`` returns indices into (the layer's hot buffers)."""
        return self._need_worker("hot_rows").hot_view(layer_name)

    def load_host_rows(self, layer_name: str, keys: Any):
        """Host-pool rows ``keys`` of the layer on the compute device (prefill reads)."""
        return self._need_worker("load_host_rows").load_host_rows(layer_name, keys)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._need_worker("wait_for_layer_load").wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Write the layer's rows computed this step (``kv_layer``) into the host pool at
        ``attn_metadata.slot_mapping`` (or ``slot_mapping=`` keyword)."""
        worker = self._need_worker("save_kv_layer")
        slots = kwargs.get("slot_mapping")
        if slots is None:
            slots = getattr(attn_metadata, "slot_mapping", None)
        if slots is None:
            raise ValueError("save_kv_layer needs attn_metadata.slot_mapping (or slot_mapping=)")
        worker.save_kv_layer(layer_name, kv_layer, slots)

    def clear_connector_metadata(self) -> None:
        """End of the step: a ``resolve`` before the next ``start_load_kv`` is refused by name."""
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.end_step()

    def wait_for_save(self) -> None:
        """Nothing to wait for: host writes and gathers are ordered on the copy streams."""
        return None

    def get_finished(self, finished_req_ids: set) -> tuple:
        """Nothing asynchronous outlives a step: (None, None)."""
        return None, None

    def get_kv_connector_stats(self) -> Optional[HiSparseKVConnectorStats]:
        if self.worker is None:
            return self._scheduler.gauges() if self._scheduler is not None else None
        if self.has_connector_metadata() and not self._get_connector_metadata().req_ids:
            # A step with nothing scheduled (vLLM runs one after the last request finishes, to
            # pass on its id): nothing decodes, so waiting for the counters costs nothing, and the
            # last steps' counts reach the scrape now instead of with the next request.
            return self.worker.drain_stats()
        return self.worker.get_kv_connector_stats()

    # vLLM >= 0.33's sleep-mode hooks. Sleep mode frees and remaps vLLM's KV cache (the indexer
    # caches here) under live state rows, hot buffers and host-pool keys that would then name
    # stale rows; it is refused at start-up (``supports_sleep_mode``), so these never run.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        return False

    def unregister_kv_caches(self) -> None:
        raise RuntimeError(SLEEP_MODE_REFUSAL)

    def restore_kv_caches(self) -> None:
        raise RuntimeError(SLEEP_MODE_REFUSAL)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        return None

    # -------------------------------------------------------- scheduler side
    def _need_scheduler(self, what: str) -> HiSparseScheduler:
        if self._scheduler is None:
            raise RuntimeError(
                f"{what} is a scheduler-side call; this connector has the worker role"
            )
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        """HiSparse never loads KV from outside the engine."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        """The step's metadata; a preempted request's state row is released here, and the row it
        gets when vLLM resumes it is logged (one line per resumption)."""
        sched = self._need_scheduler("build_connector_meta")
        self._preemptions.before(sched.rows, scheduler_output)
        meta = sched.build(scheduler_output)
        self._preemptions.after(sched.rows, meta.req_ids)
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple:
        """Free the request's state row; the worker resets it (drops its hot state) next step."""
        rid = request_id(request)
        self._need_scheduler("request_finished").release(rid)
        self._preemptions.forget(rid)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple:
        return self.request_finished(request, block_ids)

    def invalidate_keys(self, request: Any, keys: Any) -> None:
        """Scheduler side: positions of ``request`` were rewritten; drop their hot copies next
        step."""
        rid = request if isinstance(request, str) else request_id(request)
        self._need_scheduler("invalidate_keys").invalidate_keys(rid, keys)

    # ------------------------------------------------------------- telemetry
    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> HiSparseKVConnectorStats:
        return (
            HiSparseKVConnectorStats(data=data) if data is not None else HiSparseKVConnectorStats()
        )

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HiSparsePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class HiSparseOOTConnector(HiSparseConnector):
    """The same connector under a name vLLM does not reserve.

    vLLM >= 0.32 ships an in-tree connector registered as ``HiSparseConnector`` and keys its own
    HiSparse attention path on that *name*. hisparse's plugin routes the name here when the
    module path is hisparse's; this name works whether or not that patch applies."""
