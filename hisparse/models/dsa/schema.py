"""The one schema of a DeepSeek-V3.2 / GLM-5 config: every field ``DSAConfig.from_hf`` and
``DecoderSpec.from_hf`` read, with its type, its range and the rules between fields.

Fields are checked the way op arguments are (``hisparse.ops.limits.as_index``): an integer field
takes an integer and nothing else (a bool, a float or a numeric string is refused, not
coerced), a number field also takes an integer, a flag takes only true / false. Every refusal
is one line naming the key, the rule and the value, before any weight is read:
``config.json: index_topk must be <= max_position_embeddings (512), got 600``.

Configs come as config.json dicts or as transformers / vLLM config objects (attributes); a field
that is absent or None is unset, and takes transformers' default for the architecture where it
has one. Keys the schema does not list are ignored: released configs carry many more.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from hisparse.models.rows import ROW_FORMATS
from hisparse.ops.limits import INT32_MAX, as_index

#: config.json key (``--hf-overrides``) choosing the latent row format.
ROW_FORMAT_KEY = "hisparse_row_format"
#: Bounds far past any released model, so that a value beyond them is a typo, not a plan.
MAX_LAYERS = 1024
MAX_WIDTH = 2**20

# name: (lowest, highest, why). Positions and vocabulary ids are int32 keys in the connector.
INTS: Dict[str, Tuple[int, int, str]] = {
    "num_hidden_layers": (1, MAX_LAYERS, ""),
    "hidden_size": (1, MAX_WIDTH, ""),
    "num_attention_heads": (1, MAX_WIDTH, ""),
    "q_lora_rank": (1, MAX_WIDTH, " (the indexer reads the query latent)"),
    "kv_lora_rank": (1, MAX_WIDTH, " (the latent row width)"),
    "qk_rope_head_dim": (2, MAX_WIDTH, " (the rotary pairs of a row and an index key)"),
    "qk_nope_head_dim": (1, MAX_WIDTH, ""),
    "v_head_dim": (1, MAX_WIDTH, ""),
    "index_topk": (1, MAX_WIDTH, ""),
    "index_n_heads": (1, MAX_WIDTH, ""),
    "index_head_dim": (2, MAX_WIDTH, ""),
    "index_topk_freq": (1, MAX_LAYERS, ""),
    "index_skip_topk_offset": (0, MAX_LAYERS, ""),
    "vocab_size": (2, INT32_MAX, " (greedy decoding compares the best two tokens)"),
    "max_position_embeddings": (1, INT32_MAX, ""),
    "first_k_dense_replace": (0, MAX_LAYERS, ""),
    "n_routed_experts": (1, MAX_WIDTH, ""),
    "num_local_experts": (1, MAX_WIDTH, ""),
    "num_experts_per_tok": (1, MAX_WIDTH, ""),
    "n_group": (1, MAX_WIDTH, ""),
    "topk_group": (1, MAX_WIDTH, ""),
    "n_shared_experts": (0, MAX_WIDTH, ""),
    "intermediate_size": (1, MAX_WIDTH, ""),
    "moe_intermediate_size": (1, MAX_WIDTH, ""),
}
# name: (exclusive lower bound, exclusive upper bound or None, why).
REALS: Dict[str, Tuple[float, Optional[float], str]] = {
    "rms_norm_eps": (0.0, 1.0, ""),
    "rope_theta": (1.0, None, " (the rotary frequencies are its negative powers)"),
    "routed_scaling_factor": (0.0, None, ""),
}
# name: the one value the code supports, or None where either is fine.
BOOLS: Dict[str, Optional[bool]] = {
    "norm_topk_prob": None,
    "tie_word_embeddings": None,
    "indexer_rope_interleave": None,
    "attention_bias": False,
}
# name: the values the code supports (transformers' routing, vLLM's MLP, our row formats).
CHOICES: Dict[str, Tuple[str, ...]] = {
    "hidden_act": ("silu",),
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
    ROW_FORMAT_KEY: tuple(sorted(ROW_FORMATS)),
}
# Inside rope_parameters / rope_scaling with rope_type yarn: name -> exclusive lower bound.
YARN_REALS = {"factor": 0.0, "beta_fast": 0.0, "beta_slow": 0.0, "attention_factor": 0.0}
YARN_MSCALES = ("mscale", "mscale_all_dim")  # 0 means unset in transformers' YaRN

#: transformers' config defaults where a config leaves a field out (they differ per arch).
DEFAULTS = {
    "deepseek_v32": {"n_group": 8, "topk_group": 4, "rms_norm_eps": 1e-6},
    "glm_moe_dsa": {"n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5},
}
COMMON_DEFAULTS = {
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "index_topk_freq": 1,
    "index_skip_topk_offset": 2,
}


class DSAConfigError(ValueError):
    """A config field is missing, of the wrong type or out of range (the message names it)."""


def raw(hf: Any, name: str) -> Any:
    """The field as the config holds it (dict key or attribute); None when unset."""
    if isinstance(hf, Mapping):
        return hf.get(name)
    return getattr(hf, name, None)


def _show(v: Any) -> str:
    return f"{type(v).__name__} {v!r}".replace("\n", " ")


def check_int(key: str, v: Any, lo: int, hi: int, why: str = "") -> int:
    """An integer (as op arguments take them: not a bool, a float or a string) in [lo, hi]."""
    v = as_index(f"config.json: {key}", v, error=DSAConfigError)
    if lo == hi and v != lo:
        raise DSAConfigError(f"config.json: {key} must be {lo}{why}, got {v}")
    if v < lo:
        raise DSAConfigError(f"config.json: {key} must be >= {lo}{why}, got {v}")
    if v > hi:
        raise DSAConfigError(f"config.json: {key} must be <= {hi}{why}, got {v}")
    return v


def check_real(
    key: str, v: Any, lo: float, hi: Optional[float] = None, why: str = "", lo_ok: bool = False
) -> float:
    """A finite number (an integer too, not a bool or a string) above ``lo`` (or equal to it
    with ``lo_ok``) and below ``hi``, as a float."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise DSAConfigError(f"config.json: {key} must be a number, got {_show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer past the float range
        f = math.inf
    if not math.isfinite(f):
        raise DSAConfigError(f"config.json: {key} must be a finite number, got {v!r}")
    if f < lo or (f == lo and not lo_ok):
        rule = ">=" if lo_ok else ">"
        raise DSAConfigError(f"config.json: {key} must be {rule} {lo:g}{why}, got {v!r}")
    if hi is not None and f >= hi:
        raise DSAConfigError(f"config.json: {key} must be < {hi:g}{why}, got {v!r}")
    return f


def _check(name: str, v: Any) -> Any:
    if name in INTS:
        return check_int(name, v, *INTS[name])
    if name in REALS:
        return check_real(name, v, *REALS[name])
    if name in BOOLS:
        if not isinstance(v, bool):
            raise DSAConfigError(f"config.json: {name} must be true or false, got {_show(v)}")
        if BOOLS[name] is not None and v != BOOLS[name]:
            raise DSAConfigError(f"config.json: {name} must be {BOOLS[name]}, got {v}")
        return v
    choices = CHOICES[name]
    if v not in choices:
        want = repr(choices[0]) if len(choices) == 1 else f"one of {list(choices)}"
        raise DSAConfigError(f"config.json: {name} must be {want}, got {v!r}")
    return v


def get(hf: Any, name: str, arch: str = "") -> Any:
    """The checked field, else its default for ``arch``, else None."""
    v = raw(hf, name)
    if v is None:
        return DEFAULTS.get(arch, {}).get(name, COMMON_DEFAULTS.get(name))
    return _check(name, v)


def need(hf: Any, name: str, arch: str = "") -> Any:
    """The checked field (or its default); one line naming it when the config lacks it."""
    v = get(hf, name, arch)
    if v is None:
        raise DSAConfigError(f"config.json lacks {name!r}, which a DSA model needs")
    return v


def experts_key(hf: Any) -> str:
    """transformers writes n_routed_experts; some configs spell it num_local_experts."""
    return "num_local_experts" if raw(hf, "n_routed_experts") is None else "n_routed_experts"


def layer_list(hf: Any, name: str, allowed: Sequence[str], layers: int):
    """A per-layer list of ``allowed`` kinds (tuple), or None when unset."""
    v = raw(hf, name)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or len(v) != layers or any(t not in allowed for t in v):
        names = "/".join(repr(a) for a in allowed)
        raise DSAConfigError(
            f"config.json: {name} must list {names} for each of the {layers} layers, "
            f"got {_show(v)[:120]}"
        )
    return tuple(v)


def index_pattern(hf: Any) -> Optional[str]:
    """index_topk_pattern: one 'F' (full) or 'S' (shared) per layer, or None when unset."""
    v = raw(hf, "index_topk_pattern")
    if v is not None and (not isinstance(v, str) or set(v) - {"F", "S"}):
        raise DSAConfigError(
            f"config.json: index_topk_pattern must be a string of 'F' and 'S', got {_show(v)}"
        )
    return v


def rope(hf: Any) -> dict:
    """rope_parameters (transformers 5) or rope_scaling (older), checked, with rope_theta and
    rope_type filled in and numbers as int / float."""
    src = "rope_parameters" if raw(hf, "rope_parameters") else "rope_scaling"
    params = raw(hf, src) or {}
    if not isinstance(params, Mapping):
        raise DSAConfigError(f"config.json: {src} must be an object, got {_show(params)}")
    out = dict(params)
    kind = out.get("rope_type") or out.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise DSAConfigError(
            f"config.json: {src}.rope_type must be 'default' or 'yarn', got {kind!r}"
        )
    out["rope_type"] = kind
    if out.get("rope_theta") is None:
        out["rope_theta"] = get(hf, "rope_theta")
    else:
        out["rope_theta"] = check_real(f"{src}.rope_theta", out["rope_theta"], *REALS["rope_theta"])
    if kind != "yarn":
        return out
    if out.get("factor") is None:
        raise DSAConfigError(
            f"config.json: {src} has rope_type 'yarn' but no 'factor' (YaRN's context scale)"
        )
    for name, lo in YARN_REALS.items():
        if out.get(name) is not None:
            out[name] = check_real(f"{src}.{name}", out[name], lo)
    for name in YARN_MSCALES:
        if out.get(name) is not None:
            out[name] = check_real(f"{src}.{name}", out[name], 0.0, lo_ok=True)
    orig = out.get("original_max_position_embeddings")
    if orig is not None:
        key = f"{src}.original_max_position_embeddings"
        out["original_max_position_embeddings"] = check_int(key, orig, 1, INT32_MAX)
    if out.get("truncate") is not None and not isinstance(out["truncate"], bool):
        raise DSAConfigError(
            f"config.json: {src}.truncate must be true or false, got {_show(out['truncate'])}"
        )
    return out


def _shown(hf: Any, name: str, v: Any) -> str:
    return f"{v}" if raw(hf, name) is not None else f"{v} by default"


def validate(hf: Any, arch: str) -> None:
    """Every schema field the config sets, its rope parameters and the rules between fields;
    the first violation raises ``DSAConfigError``. Fields it lacks are the readers' business."""
    for name in (*INTS, *REALS, *BOOLS, *CHOICES):
        get(hf, name, arch)
    rope(hf)
    index_pattern(hf)
    topk, positions = get(hf, "index_topk"), get(hf, "max_position_embeddings")
    if topk is not None and positions is not None and topk > positions:
        raise DSAConfigError(
            f"config.json: index_topk must be <= max_position_embeddings ({positions}), got {topk}"
        )
    groups, top_groups = get(hf, "n_group", arch), get(hf, "topk_group", arch)
    if groups is not None and top_groups is not None and top_groups > groups:
        raise DSAConfigError(
            f"config.json: topk_group must be <= n_group ({_shown(hf, 'n_group', groups)}), "
            f"got {_shown(hf, 'topk_group', top_groups)}"
        )
    key = experts_key(hf)
    experts, per_token = get(hf, key), get(hf, "num_experts_per_tok")
    if experts is None:
        return
    if groups is not None and experts % groups:
        raise DSAConfigError(
            f"config.json: {key} must split into n_group ({_shown(hf, 'n_group', groups)}) "
            f"equal groups, got {experts}"
        )
    if per_token is not None and per_token > experts:
        raise DSAConfigError(
            f"config.json: num_experts_per_tok must be <= {key} ({experts}), got {per_token}"
        )
    if per_token is not None and groups and top_groups:
        # Routing keeps the experts of the best topk_group groups only, then takes the top k.
        kept = top_groups * (experts // groups)
        if per_token > kept:
            raise DSAConfigError(
                f"config.json: num_experts_per_tok must be <= topk_group * {key} / n_group "
                f"({kept}, the experts routing keeps), got {per_token}"
            )
