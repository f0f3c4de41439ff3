"""``HiSparseConnector``: the class vLLM's ``--kv-transfer-config`` names
(``kv_connector_module_path="hisparse.vllm.connector"``). It subclasses vLLM's KV-connector base
(hisparse's stand-in where vLLM is absent, ``hisparse.vllm.compat``), reads vLLM's objects (its
config, each step's scheduler output, the worker's TP group, the model's layers) and delegates
the work to the vLLM-free ``hisparse.connector.HiSparseConnectorImpl``. See docs/vllm.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hisparse.connector import HiSparseConnectorImpl, HiSparseConnectorMetadata, StepSchedule
from hisparse.connector.lifecycle import SLEEP_MODE_REFUSAL, connector_role
from hisparse.connector.stats import HiSparseKVConnectorStats, HiSparsePromMetrics
from hisparse.vllm.compat import (
    HAVE_VLLM,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    SupportsHMA,
    scheduled_requests,
    tensor_parallel_peers,
)
from hisparse.vllm.settings import config_from_vllm, extra_config

__all__ = ["HAVE_VLLM", "HiSparseConnector", "HiSparseOOTConnector"]


@dataclass(frozen=True)
class VllmConnectorMetadata(HiSparseConnectorMetadata, KVConnectorMetadata):
    """The step's metadata as vLLM ships it between its processes."""


@dataclass
class VllmConnectorStats(HiSparseKVConnectorStats, KVConnectorStats):
    """HiSparse's stats as vLLM's stats pipeline aggregates them."""


class VllmPromMetrics(HiSparsePromMetrics, KVConnectorPromMetrics):
    """HiSparse's Prometheus metrics on vLLM's metric classes and labels."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        KVConnectorPromMetrics.__init__(
            self, vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        HiSparsePromMetrics.__init__(self, metric_types, labelnames, per_engine_labelvalues)


def _vllm_stats(stats: Optional[HiSparseKVConnectorStats]) -> Optional[VllmConnectorStats]:
    return None if stats is None else VllmConnectorStats(data=stats.data)


class HiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    """HiSparse hot-buffering as a vLLM KV connector: nothing is loaded from outside; the worker
    role keeps the full KV in a pinned host pool and each request's selected rows in hot
    buffers (``impl``)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        role = connector_role(role, KVConnectorRole)
        super().__init__(vllm_config, role, kv_cache_config)
        worker = role == KVConnectorRole.WORKER
        # Inside an engine the worker is built after the model is loaded: the model's own layers
        # must call us, and a model without HiSparse layers is refused first, at start-up.
        found = None
        if worker and getattr(vllm_config, "model_config", None) is not None:
            from hisparse.vllm.model_check import model_hisparse_layers

            found = model_hisparse_layers(vllm_config)
        config = config_from_vllm(vllm_config)
        layers = None
        if found is not None:
            from hisparse.vllm.model_check import find_model_layers

            extra = extra_config(vllm_config)
            layers = find_model_layers(vllm_config, kv_cache_config, config, extra, found)
        blocks = getattr(kv_cache_config, "num_blocks", None)
        host_rows = None
        if not worker and isinstance(blocks, int) and blocks > 0:
            host_rows = blocks * config.block_size
        self.impl = HiSparseConnectorImpl(
            config,
            "worker" if worker else "scheduler",
            host_rows=host_rows,
            model_layers=layers,
            metadata_class=VllmConnectorMetadata,
        )

    @property
    def config(self):
        return self.impl.config

    @property
    def worker(self):
        return self.impl.worker

    # ------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        # The TP ranks of one host share one host pool where they can (connector/tp_pool.py).
        self.impl.register_kv_caches(kv_caches, peers=tensor_parallel_peers())

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.impl.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.impl.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.impl.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.impl.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.impl.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        return self.impl.wait_for_save()

    def get_finished(self, finished_req_ids: set) -> tuple:
        return self.impl.get_finished(finished_req_ids)

    def get_kv_connector_stats(self) -> Optional[VllmConnectorStats]:
        return _vllm_stats(self.impl.get_kv_connector_stats())

    def shutdown(self) -> None:
        return self.impl.shutdown()

    # What the models' HiSparse layers call (hisparse.vllm.dsa.attention).
    def resolve(
        self,
        layer_name: str,
        top_k: Any,
        resident_rows: Any = None,
        *,
        state_rows=None,
        defer_misses: bool = False,
    ):
        return self.impl.resolve(
            layer_name, top_k, resident_rows, state_rows=state_rows, defer_misses=defer_misses
        )

    def miss_plan(self, layer_name: str):
        return self.impl.miss_plan(layer_name)

    def next_pass(self) -> None:
        self.impl.next_pass()

    def batch_state_rows(self, anchor_keys: Any):
        return self.impl.batch_state_rows(anchor_keys)

    def host_rows(self, layer_name: str):
        return self.impl.host_rows(layer_name)

    def hot_rows(self, layer_name: str):
        return self.impl.hot_rows(layer_name)

    def load_host_rows(self, layer_name: str, keys: Any):
        return self.impl.load_host_rows(layer_name, keys)

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

    # ---------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        return self.impl.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return self.impl.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> VllmConnectorMetadata:
        step = StepSchedule(
            num_scheduled_tokens=getattr(scheduler_output, "num_scheduled_tokens", None),
            finished_req_ids=set(getattr(scheduler_output, "finished_req_ids", None) or ()),
            preempted_req_ids=set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            blocks=scheduled_requests(scheduler_output),
        )
        meta = self.impl.build_connector_meta(step)
        if hasattr(scheduler_output, "has_sync_kv_loads"):
            # State rows must be bound before the forward, not after it (vLLM's default for
            # connectors without synchronous loads).
            scheduler_output.has_sync_kv_loads = True
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple:
        return self.impl.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple:
        return self.impl.request_finished(request, block_ids)

    # --------------------------------------------------------------- telemetry
    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> VllmConnectorStats:
        return VllmConnectorStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return VllmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class HiSparseOOTConnector(HiSparseConnector):
    """The same connector under a name vLLM does not reserve.

    vLLM >= 0.32 ships an in-tree connector registered as ``HiSparseConnector`` and keys its own
    HiSparse attention path on that *name*. hisparse's plugin routes the name here when the
    module path is hisparse's; this name works whether or not that patch applies."""
