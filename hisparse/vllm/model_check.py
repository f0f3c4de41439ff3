"""What the worker connector needs from a vLLM engine, checked once at start-up.

A model takes part in HiSparse through layers that carry ``row_bytes`` (bytes of one KV row) and
``group_leader`` (the layer whose indexer picks their top-k), registered in vLLM's
``static_forward_context`` (``hisparse.vllm.cache_layers.SparseMLACache``). A model without
such layers (any stock vLLM model) would never call the connector: it is refused here, before
the first request, with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from hisparse.connector.config import HiSparseConfig, HiSparseConfigError


@dataclass(frozen=True)
class ModelLayers:
    row_bytes: dict  # {layer_name: row bytes}, model order
    groups: list  # [[leader, follower, ...], ...]
    host_rows: int  # keys = vLLM slots: num_blocks * block_size
    top_k: Optional[int]


class HiSparseModelError(RuntimeError):
    """The served model cannot run with the HiSparse connector (one line says why)."""


def _architectures(vllm_config: Any) -> str:
    archs = getattr(getattr(vllm_config, "model_config", None), "architectures", None)
    return ", ".join(archs) if archs else "unknown"


def _message(archs: str) -> str:
    from hisparse.vllm.dsa import override_hint

    hint = override_hint(archs)
    if hint:  # DeepSeek-V3.2 / GLM-5: vLLM's own class never calls the connector
        return f"HiSparse connector: model architecture {archs} is vLLM's own; add {hint}"
    return (
        f"HiSparse connector: model architecture {archs} has no HiSparse sparse-attention "
        "layers, so nothing would call the connector; serve a model whose attention calls it "
        "(e.g. a directory from `hisparse export-model`) or drop --kv-transfer-config"
    )


def _registered_by_hisparse(arch: str) -> bool:
    from vllm import ModelRegistry

    entry = getattr(ModelRegistry, "models", {}).get(arch)
    module = getattr(entry, "module_name", None) or getattr(
        getattr(entry, "model_cls", None), "__module__", ""
    )
    return isinstance(module, str) and module.split(".")[0] == "hisparse"


def refuse_stock_architecture(vllm_config: Any) -> None:
    """At config time, before any weights load: with hisparse's connector, the architecture must
    be one hisparse registered (its attention calls the connector); else one line says so."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    path = getattr(kv, "kv_connector_module_path", None)
    if not isinstance(path, str) or path.split(".")[0] != "hisparse":
        return
    archs = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or []
    if not any(_registered_by_hisparse(a) for a in archs):
        raise HiSparseModelError(_message(_architectures(vllm_config)))


def model_hisparse_layers(vllm_config: Any) -> Optional[dict]:
    """The loaded model's HiSparse layers by name; None when no model is loaded in this process
    (a caller driving the worker itself, e.g. a test). A loaded model without any is refused
    with one line."""
    ctx = (
        getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
        or {}
    )
    if not ctx:
        return None
    layers = {
        n: lay
        for n, lay in ctx.items()
        if hasattr(lay, "row_bytes") and hasattr(lay, "group_leader")
    }
    if not layers:
        raise HiSparseModelError(_message(_architectures(vllm_config)))
    return layers


def find_model_layers(
    vllm_config: Any,
    kv_cache_config: Any,
    config: HiSparseConfig,
    extra: Optional[Mapping],
    layers: Mapping,
) -> ModelLayers:
    """Groups, host rows and the pool check for the model's HiSparse ``layers``."""
    groups: dict = {}
    for name, lay in layers.items():
        if lay.group_leader not in layers:
            raise HiSparseModelError(
                f"HiSparse layer {name!r} names leader "
                f"{lay.group_leader!r}, which is not a HiSparse layer"
            )
        groups.setdefault(lay.group_leader, [lay.group_leader])
        if name != lay.group_leader:
            groups[lay.group_leader].append(name)
    # DeepSeek-V3.2 / GLM-5 (hisparse.vllm.dsa): the indexer's top-k
    top_k = getattr(getattr(vllm_config.model_config, "hf_config", None), "index_topk", None)
    extra = dict(extra or {})
    if top_k is not None and extra.get("top_k", top_k) != top_k:
        raise HiSparseConfigError(
            f"kv_connector_extra_config['top_k'] = {extra['top_k']} differs from the model's "
            f"top-k ({top_k}); leave it unset"
        )
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise HiSparseModelError(
            "HiSparse connector: vLLM passed no KV cache config with "
            "num_blocks; the host pool backs vLLM's KV blocks"
        )
    host_rows = num_blocks * config.block_size
    row_bytes = {n: int(lay.row_bytes) for n, lay in layers.items()}
    need = host_rows * sum(row_bytes.values())
    if config.host_pool_set and need > config.host_pool_bytes:
        raise HiSparseConfigError(
            f"kv_connector_extra_config['host_pool_gib'] = {config.host_pool_gib} is smaller "
            f"than vLLM's {num_blocks} KV blocks need ({need / 2**30:.3f} GiB): raise it, or "
            "leave it unset to size the pool to the blocks, or cap them with "
            "--num-gpu-blocks-override"
        )
    return ModelLayers(row_bytes, list(groups.values()), host_rows, top_k)
