"""The connector layer, free of vLLM: ``HiSparseConnectorImpl`` (the KV-connector contract over
its scheduler and worker halves), the units the worker composes, the message between the halves,
the settings, the stats container and the Prometheus side. ``hisparse.vllm.connector`` is what
vLLM's ``--kv-transfer-config`` names: it subclasses vLLM's base and delegates here.

May import: ``hisparse.runtime``, ``hisparse.ops``; never vLLM nor ``hisparse.vllm``.
"""

from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.connector.facade import (
    ConnectorRole,
    HiSparseConnectorImpl,
    HiSparseConnectorMetadata,
    HiSparseConnectorWorker,
    StepSchedule,
)

__all__ = [
    "ConnectorRole",
    "HiSparseConfig",
    "HiSparseConfigError",
    "HiSparseConnectorImpl",
    "HiSparseConnectorMetadata",
    "HiSparseConnectorWorker",
    "StepSchedule",
]
