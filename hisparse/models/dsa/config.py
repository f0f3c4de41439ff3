"""``DSAConfig``: the fields of a DeepSeek-V3.2 or GLM-5 config.json the sparse-attention math
needs, read from a dict or a transformers config in either spelling.

transformers 5 writes ``rope_parameters`` and (GLM-5) ``indexer_types``; vLLM and older
checkpoints use ``rope_scaling`` and ``index_topk_freq`` / ``index_skip_topk_offset`` /
``index_topk_pattern``. Both are honoured. Every error is one line naming the field.

Index groups: a ``"full"`` layer runs its own indexer; each ``"shared"`` layer after it reuses
that top-k (``leader(layer)``). DeepSeek-V3.2 layers are all full (groups of one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from hisparse.models.rows import LATENT_DIM, ROPE_DIM, ROW_LAYOUTS

ARCHS = {"DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}
MODEL_TYPES = {"deepseek_v32": "deepseek_v32", "glm_moe_dsa": "glm_moe_dsa"}
#: config.json key (``--hf-overrides``) choosing the latent row format.
ROW_FORMAT_KEY = "hisparse_row_format"


class DSAConfigError(ValueError):
    """A config field is missing or unsupported (the message names it)."""


def _get(hf: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf, Mapping):
        return hf.get(name, default)
    return getattr(hf, name, default)


def _need(hf: Any, name: str) -> Any:
    v = _get(hf, name)
    if v is None:
        raise DSAConfigError(f"config.json lacks {name!r}, which a DSA model needs")
    return v


def _rope_dict(hf: Any) -> dict:
    """rope_parameters (transformers 5) or rope_scaling (older), with rope_theta folded in."""
    rope = _get(hf, "rope_parameters") or _get(hf, "rope_scaling") or {}
    rope = dict(rope)
    rope.setdefault("rope_theta", _get(hf, "rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = kind
    if kind not in ("default", "yarn"):
        raise DSAConfigError(f"rope_parameters.rope_type {kind!r} is not supported (default, yarn)")
    return rope


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _indexer_types(hf: Any, arch: str, layers: int) -> Tuple[str, ...]:
    if arch == "deepseek_v32":  # transformers' DeepSeek-V3.2 runs every layer's indexer
        return ("full",) * layers
    types = _get(hf, "indexer_types")
    pattern = _get(hf, "index_topk_pattern")
    if types is None and pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq = max(int(_get(hf, "index_topk_freq", 1) or 1), 1)
        off = int(_get(hf, "index_skip_topk_offset", 2))
        types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or any(t not in ("full", "shared") for t in types):
        raise DSAConfigError(
            f"indexer_types must list 'full'/'shared' for each of the {layers} layers"
        )
    if types[0] != "full":
        raise DSAConfigError("indexer_types[0] must be 'full' (a shared layer reuses a full one)")
    return types


@dataclass(frozen=True)
class DSAConfig:
    arch: str  # "deepseek_v32" | "glm_moe_dsa"
    num_layers: int
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    indexer_rope_interleave: bool
    indexer_types: Tuple[str, ...]
    softmax_scale: float  # MLA score scale, YaRN mscale folded in
    rope: Tuple[Tuple[str, Any], ...]  # rope parameters (sorted items)
    row_format: Optional[str]  # None: the unquantized format of the serving dtype

    @staticmethod
    def from_hf(hf: Any) -> "DSAConfig":
        archs = list(_get(hf, "architectures") or [])
        arch = MODEL_TYPES.get(_get(hf, "model_type", ""))
        arch = arch or next((ARCHS[a] for a in archs if a in ARCHS), None)
        if arch is None:
            raise DSAConfigError(
                f"model_type {_get(hf, 'model_type')!r} is neither deepseek_v32 nor glm_moe_dsa"
            )
        if int(_need(hf, "kv_lora_rank")) != LATENT_DIM:
            raise DSAConfigError(f"kv_lora_rank must be {LATENT_DIM} (the latent row width)")
        if int(_need(hf, "qk_rope_head_dim")) != ROPE_DIM:
            raise DSAConfigError(f"qk_rope_head_dim must be {ROPE_DIM} (the row's rope part)")
        if not _get(hf, "q_lora_rank"):
            raise DSAConfigError("q_lora_rank must be set (the indexer reads the query latent)")
        for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            got = _get(hf, name)
            if got is not None and got != want:
                raise DSAConfigError(
                    f"{name} must be {want!r} (transformers' routing), got {got!r}"
                )
        fmt = _get(hf, ROW_FORMAT_KEY)
        if fmt is not None and fmt not in ROW_LAYOUTS:
            raise DSAConfigError(
                f"{ROW_FORMAT_KEY} must be one of {sorted(ROW_LAYOUTS)}, got {fmt!r}"
            )
        layers = int(_need(hf, "num_hidden_layers"))
        nope = int(_need(hf, "qk_nope_head_dim"))
        rope = _rope_dict(hf)
        scale = (nope + ROPE_DIM) ** -0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
        index_head_dim = int(_need(hf, "index_head_dim"))
        if index_head_dim < ROPE_DIM:
            raise DSAConfigError(f"index_head_dim must be >= qk_rope_head_dim ({ROPE_DIM})")
        interleave = _get(hf, "indexer_rope_interleave")
        return DSAConfig(
            arch=arch,
            num_layers=layers,
            hidden_size=int(_need(hf, "hidden_size")),
            num_heads=int(_need(hf, "num_attention_heads")),
            q_lora_rank=int(_get(hf, "q_lora_rank")),
            qk_nope_head_dim=nope,
            v_head_dim=int(_need(hf, "v_head_dim")),
            index_topk=int(_need(hf, "index_topk")),
            index_n_heads=int(_need(hf, "index_n_heads")),
            index_head_dim=index_head_dim,
            indexer_rope_interleave=(arch == "glm_moe_dsa")
            if interleave is None
            else bool(interleave),
            indexer_types=_indexer_types(hf, arch, layers),
            softmax_scale=scale,
            rope=tuple(sorted(rope.items())),
            row_format=fmt,
        )

    def is_full(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"

    def leader(self, layer: int) -> int:
        """The full layer whose top-k ``layer`` uses (itself when full)."""
        while not self.is_full(layer):
            layer -= 1
        return layer

    def rope_parameters(self) -> dict:
        return dict(self.rope)

    def row_format_for(self, dtype_name: str) -> str:
        """The row format: the configured one, else the unquantized one of the serving dtype."""
        if self.row_format is not None:
            return self.row_format
        return "f32" if dtype_name == "float32" else "bf16"
