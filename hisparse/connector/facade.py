"""``HiSparseConnectorImpl``: HiSparse on the KV-connector contract, free of vLLM.

The scheduler half (state rows, token counts, each step's metadata) and the worker half (host
pool, hot buffers, resolve, save, stats) behind the method names of vLLM's KV-connector
contract. The DSA engine (``hisparse.engine.dsa``) drives it directly; inside vLLM,
``hisparse.vllm.connector``'s ``HiSparseConnector`` subclasses vLLM's base and delegates here.
See docs/connector.md.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.lifecycle import Preemptions, connector_role, request_id
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.scheduler import HiSparseScheduler, StepSchedule
from hisparse.connector.stats import HiSparseKVConnectorStats, HiSparsePromMetrics
from hisparse.connector.worker import HiSparseConnectorWorker

__all__ = [
    "ConnectorRole",
    "HiSparseConnectorImpl",
    "HiSparseConnectorMetadata",
    "HiSparseConnectorWorker",
    "StepSchedule",
]


class ConnectorRole(enum.Enum):
    """The two halves, as vLLM numbers its ``KVConnectorRole``."""

    SCHEDULER = 0
    WORKER = 1


class HiSparseConnectorImpl:
    """HiSparse hot-buffering as a KV connector: nothing is loaded from outside; the worker role
    keeps the full KV in a pinned host pool and each request's selected rows in hot buffers.

    ``role``: ``"scheduler"`` / ``"worker"`` (or a role enum with those names). ``device_hooks``:
    stand-ins for the worker's stream/event/capture plumbing (``hisparse.connector.sampler``),
    for tests. ``host_rows`` (scheduler role): the worker's host-pool rows, so that keys and
    token counts past the pool are refused where they enter. ``model_layers``: the served
    model's HiSparse layers (``hisparse.connector.registration.ModelLayers``), when the engine
    keeps its own paged caches and the connector allocates the hot buffers and the pool.
    ``metadata_class``: the step metadata's class (a subclass where the engine needs its own
    base, as vLLM does)."""

    def __init__(
        self,
        config: HiSparseConfig,
        role: Any = "worker",
        *,
        device_hooks=None,
        host_rows: Optional[int] = None,
        model_layers: Any = None,
        metadata_class: type = HiSparseConnectorMetadata,
    ) -> None:
        if not isinstance(config, HiSparseConfig):
            raise TypeError(
                f"config must be a HiSparseConfig (hisparse.connector.config), got "
                f"{type(config).__name__}"
            )
        self.config = config
        self.role = connector_role(role, ConnectorRole)
        self._metadata: Optional[HiSparseConnectorMetadata] = None
        self._model_layers = model_layers
        self.worker: Optional[HiSparseConnectorWorker] = None
        self._scheduler: Optional[HiSparseScheduler] = None
        if self.role == ConnectorRole.WORKER:
            self.worker = HiSparseConnectorWorker(config, hooks=device_hooks)
        else:
            self._scheduler = HiSparseScheduler(config, metadata_class)
            self._preemptions = Preemptions()
        if host_rows is not None:
            self._need_scheduler("host_rows=...").set_host_rows(host_rows)

    # ------------------------------------------------------------- metadata
    def bind_connector_metadata(self, metadata: HiSparseConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """End of the step: a ``resolve`` before the next ``start_load_kv`` is refused by name."""
        self._metadata = None
        if self.worker is not None:
            self.worker.end_step()

    def has_connector_metadata(self) -> bool:
        return self._metadata is not None

    # ----------------------------------------------------------- worker side
    def _need_worker(self, what: str) -> HiSparseConnectorWorker:
        if self.worker is None:
            raise RuntimeError(
                f"{what} is a worker-side call; this connector has the scheduler role"
            )
        return self.worker

    def register_kv_caches(self, kv_caches: dict, *, peers: Any = None) -> None:
        """From a caller that hands over its hot buffers (the tests): bind them. With
        ``model_layers`` (vLLM, its own paged caches): leave those alone; allocate hot buffers for
        the model's HiSparse layers and a host pool backing every engine slot. ``peers``: the
        worker's tensor-parallel group (``hisparse.connector.tp_pool``), or None."""
        worker = self._need_worker("register_kv_caches")
        if self._model_layers is None:
            worker.register_kv_caches(kv_caches)
            return
        lay = self._model_layers
        S, H = self.config.max_num_seqs, self.config.hot_size
        device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        hot = {
            n: torch.zeros(S * H, rb, dtype=torch.uint8, device=device)
            for n, rb in lay.row_bytes.items()
        }
        worker.register_kv_caches(hot, host_rows=lay.host_rows, groups=lay.groups, peers=peers)

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Apply this step's metadata (reset/invalidate state rows, set the batch's state rows).
        HiSparse loads nothing from outside: the per-layer loads are the gathers ``resolve``
        launches."""
        worker = self._need_worker("start_load_kv")
        if not self.has_connector_metadata():
            raise RuntimeError("start_load_kv needs bind_connector_metadata(...) first")
        worker.start_step(self._metadata)

    def resolve(
        self,
        layer_name: str,
        top_k: Any,
        resident_rows: Any = None,
        *,
        state_rows: Any = None,
        defer_misses: bool = False,
    ):
        """After the indexer: the attention rows of ``layer_name`` for this step's top-k (rows of
        ``hot_rows(layer_name)``). Followers pass ``top_k=None`` and get the leader's plan.
        ``defer_misses``: attention's row read fetches the misses (``miss_plan``), no gather."""
        return self._need_worker("resolve").resolve(
            layer_name, top_k, resident_rows, state_rows=state_rows, defer_misses=defer_misses
        )

    def next_pass(self) -> None:
        """A further forward within this step (a speculative draft's later pass): each index
        group may resolve once more, after its members gathered the last plan."""
        self._need_worker("next_pass").next_pass()

    def miss_plan(self, layer_name: str):
        """The misses ``resolve(..., defer_misses=True)`` left to the layer's row read this step
        (``hisparse.runtime.miss_plan.MissPlan``), or None where they were gathered."""
        return self._need_worker("miss_plan").miss_plan(layer_name)

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

    def wait_for_save(self) -> None:
        """Nothing to wait for: host writes and gathers are ordered on the copy streams."""
        return None

    def get_finished(self, finished_req_ids: set) -> tuple:
        """Nothing asynchronous outlives a step: (None, None)."""
        return None, None

    def get_kv_connector_stats(self) -> Optional[HiSparseKVConnectorStats]:
        if self.worker is None:
            return self._scheduler.gauges() if self._scheduler is not None else None
        if self._metadata is not None and not self._metadata.req_ids:
            # A step with nothing scheduled (vLLM runs one after the last request finishes, to
            # pass on its id): nothing decodes, so waiting for the counters costs nothing, and the
            # last steps' counts reach the scrape now instead of with the next request.
            return self.worker.drain_stats()
        return self.worker.get_kv_connector_stats()

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

    def build_connector_meta(self, scheduler_output: StepSchedule) -> HiSparseConnectorMetadata:
        """The step's metadata; a preempted request's state row is released here, and the row it
        gets when the engine resumes it is logged (one line per resumption)."""
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

    def invalidate_keys(self, request: Any, keys: Any) -> None:
        """Scheduler side: positions of ``request`` were rewritten; drop their hot copies next
        step."""
        rid = request if isinstance(request, str) else request_id(request)
        self._need_scheduler("invalidate_keys").invalidate_keys(rid, keys)

    # ------------------------------------------------------------- telemetry
    @staticmethod
    def build_kv_connector_stats(data: Optional[dict] = None) -> HiSparseKVConnectorStats:
        return HiSparseKVConnectorStats(data=data if data is not None else {})

    @staticmethod
    def build_prom_metrics(metric_types, labelnames, per_engine_labelvalues) -> HiSparsePromMetrics:
        return HiSparsePromMetrics(metric_types, labelnames, per_engine_labelvalues)
