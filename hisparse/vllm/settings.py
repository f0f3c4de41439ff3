"""vLLM's ``kv_connector_extra_config`` parsed into a ``HiSparseConfig``: the one place where
hisparse reads its settings from vLLM. Keys the extra config leaves out come from vLLM's own
config (max_num_seqs, block_size) or the served model's (top_k = the indexer's ``index_topk``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from hisparse.connector.config import PREFIX, HiSparseConfig, HiSparseConfigError

logger = logging.getLogger("vllm.hisparse")  # under vLLM's configured "vllm" logger

#: Earlier names of settings, still read: old key -> its name now.
ALIASES = {"device_buffer_size": "hot_size"}

#: Settings no longer read (accepted, one log line each): key -> why. They never changed the
#: tokens, so a server configured with one still starts.
RETIRED = {
    "resolve_parts": "ranking and resolving the decodes in parts measured slower on a GPU, so "
    "each layer resolves its batch at once",
}
_said: set = set()  # the retired keys logged in this process

#: The ``kv_connector_module_path`` that names hisparse's connector (``hisparse.vllm.connector``).
CONNECTOR_MODULE = "hisparse.vllm.connector"


def moved_connector_line(module_path: Any) -> Optional[str]:
    """One line when ``module_path`` names a hisparse module that is not the connector's (it
    lived at ``hisparse.connector`` before the connector became free of vLLM), else None."""
    if not isinstance(module_path, str) or module_path.split(".")[0] != "hisparse":
        return None
    if module_path == CONNECTOR_MODULE:
        return None
    return (
        f"kv_connector_module_path {module_path!r} is not hisparse's connector: set "
        f"kv_connector_module_path to {CONNECTOR_MODULE!r}"
    )


def config_from_extra(extra: Optional[Mapping[str, Any]]) -> HiSparseConfig:
    """Build from ``kv_connector_extra_config`` (None or a mapping); rejects unknown keys by
    name."""
    if extra is None:
        return HiSparseConfig()
    if not isinstance(extra, Mapping):
        raise HiSparseConfigError(
            f"{PREFIX} must be a mapping of settings, got {type(extra).__name__}"
        )
    extra = _renamed(extra)
    for key in RETIRED.keys() & extra.keys():
        if key not in _said:  # once per process: vLLM parses the config several times
            logger.warning("HiSparse: %s[%r] is no longer read: %s", PREFIX, key, RETIRED[key])
            _said.add(key)
        del extra[key]
    known = set(HiSparseConfig.keys())
    unknown = sorted(str(k) for k in extra if k not in known)
    if unknown:
        raise HiSparseConfigError(
            f"{PREFIX}[{unknown[0]!r}] is not a HiSparse setting "
            f"(known: {', '.join(sorted(known))})"
        )
    return HiSparseConfig(**dict(extra))


def _renamed(extra: Mapping) -> dict:
    """``extra`` with every old key under its name now, each logged once per parse."""
    out = dict(extra)
    for old, new in ALIASES.items():
        if old not in out:
            continue
        if new in out:
            raise HiSparseConfigError(
                f"{PREFIX} sets both {old!r} and {new!r} (the same setting; {old!r} is its old "
                f"name): keep {new!r}"
            )
        logger.info("HiSparse: %s[%r] is read as %r, its name now", PREFIX, old, new)
        out[new] = out.pop(old)
    return out


def decode_query_len(vllm_config: Any) -> int:
    """Query tokens one decode request may have in a step: 1, or under speculative decoding
    vLLM's own bound (1 + num_speculative_tokens), which its batch reorder also uses."""
    spec = getattr(vllm_config, "speculative_config", None)
    n = getattr(spec, "num_speculative_tokens", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return 1
    try:
        from vllm.v1.attention.backend import max_decode_query_len
    except ImportError:  # no vLLM (stand-in configs) or a vLLM without the helper
        return 1 + n
    return int(max_decode_query_len(vllm_config))


def engine_defaults(vllm_config: Any, extra: Optional[Mapping]) -> Any:
    """``extra`` with max_num_seqs / block_size filled from vLLM's own config, top_k from the
    served model's config (the DeepSeek-V3.2 / GLM-5 indexer's ``index_topk``), where the extra
    config omits them, and decode_tokens from the speculative config."""
    if extra is not None and not isinstance(extra, Mapping):
        return extra  # config_from_extra names the problem
    merged = dict(extra or {})
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    q = decode_query_len(vllm_config)
    if merged.get("decode_tokens", q) != q:
        raise HiSparseConfigError(
            f"{PREFIX}['decode_tokens'] = {merged['decode_tokens']!r} differs from the {q} query "
            "tokens a decode has in this engine (1 + num_speculative_tokens); leave it unset"
        )
    if q > 1:
        merged["decode_tokens"] = q
    index_topk = getattr(hf, "index_topk", None)
    if "top_k" not in merged and isinstance(index_topk, int):
        merged["top_k"] = index_topk
    sched = getattr(vllm_config, "scheduler_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    seqs = getattr(sched, "max_num_seqs", None)
    block = getattr(cache, "block_size", None)
    for key, value in (("max_num_seqs", seqs), ("block_size", block)):
        usable = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if key not in merged and usable:
            merged[key] = value
    return merged


def extra_config(vllm_config: Any) -> Any:
    """The raw ``kv_connector_extra_config`` of ``vllm_config`` (None when unset)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return getattr(kv, "kv_connector_extra_config", None)


def config_from_vllm(vllm_config: Any) -> HiSparseConfig:
    """The settings a connector built from ``vllm_config`` uses (extra config + vLLM's own)."""
    return config_from_extra(engine_defaults(vllm_config, extra_config(vllm_config)))
