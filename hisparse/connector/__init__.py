"""The connector layer: the KV-connector facade (``hisparse.connector`` is the path vLLM's
``--kv-transfer-config`` names), its scheduler and worker halves and the units the worker
composes, the message between the halves, the settings, the stats container and the Prometheus
side.

May import: ``hisparse.runtime``, ``hisparse.ops``, and from the vLLM integration only
``hisparse.vllm.compat`` (vLLM's base classes where vLLM is installed, our own otherwise).
"""

from hisparse.connector.facade import (
    HAVE_VLLM,
    HiSparseConnector,
    HiSparseConnectorMetadata,
    HiSparseConnectorWorker,
    HiSparseOOTConnector,
    KVConnectorRole,
    StepSchedule,
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
