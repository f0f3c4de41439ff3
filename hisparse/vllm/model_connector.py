"""How a model class reaches the HiSparse connector: whether vLLM's config names it (the model
then declares no row storage and reads rows through it), and this process's instance.

Imported by the model classes only; ``hisparse.vllm.connector`` is the class vLLM loads.
"""

from __future__ import annotations

from typing import Any

from hisparse.vllm.settings import CONNECTOR_MODULE


def uses_hisparse_connector(vllm_config: Any) -> bool:
    """``--kv-transfer-config`` names hisparse's connector (by its module path)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return kv is not None and getattr(kv, "kv_connector_module_path", None) == CONNECTOR_MODULE


def active_connector():
    """The connector vLLM made in this process (the worker side); one line if there is none."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        raise RuntimeError(
            "the model was built for the HiSparse connector but vLLM has no "
            "KV connector in this process"
        )
    return get_kv_transfer_group()
