"""What a DSA class serves a checkpoint with, read from vLLM's config: the checkpoint's
``DSAConfig`` and the row format (config.json's ``hisparse_row_format``, else vLLM's
``--kv-cache-dtype``, else the serving dtype's). ``check`` runs it at config time, before any
process starts, so a config or flag the classes cannot serve is refused in one line there and
not after the workers have loaded the weights; the classes read the same at start-up."""

from __future__ import annotations

from typing import Any

from hisparse.models.dsa.config import DSAConfig
from hisparse.vllm.dsa import DSA_ARCHITECTURES

#: hisparse's DSA class names (the MTP draft's too).
OURS = frozenset(name for name, _ in DSA_ARCHITECTURES.values())


def row_format(vllm_config: Any, cfg: DSAConfig) -> str:
    """The row format the classes store (``DSAConfig.row_format_for``)."""
    dtype = str(getattr(vllm_config.model_config, "dtype", "")).replace("torch.", "")
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    return cfg.row_format_for(dtype, str(cache_dtype or "auto"))


def check(vllm_config: Any) -> None:
    """For one of hisparse's DSA classes: its config.json, context and row format, each refusal
    one line naming the field or flag (``DSAConfigError``); other models are not looked at."""
    model = getattr(vllm_config, "model_config", None)
    if OURS.isdisjoint(getattr(model, "architectures", None) or ()):
        return
    cfg = DSAConfig.from_hf(model.hf_config)
    cfg.check_context(int(model.max_model_len), "--max-model-len")
    row_format(vllm_config, cfg)
