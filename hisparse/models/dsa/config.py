"""``DSAConfig``: the fields of a DeepSeek-V3.2 or GLM-5 config.json the sparse-attention math
needs, read from a dict or a transformers config in either spelling and checked against
``hisparse.models.dsa.schema``.

transformers 5 writes ``rope_parameters`` and (GLM-5) ``indexer_types``; vLLM and older
checkpoints use ``rope_scaling`` and ``index_topk_freq`` / ``index_skip_topk_offset`` /
``index_topk_pattern``. Both are honoured. Every error is one line naming the field.

Index groups: a ``"full"`` layer runs its own indexer; each ``"shared"`` layer after it reuses
that top-k (``leader(layer)``). DeepSeek-V3.2 layers are all full (groups of one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from hisparse.models import rows
from hisparse.models.dsa import schema
from hisparse.models.dsa.schema import ROW_FORMAT_KEY, DSAConfigError

__all__ = ["ARCHS", "MODEL_TYPES", "ROW_FORMAT_KEY", "DSAConfig", "DSAConfigError"]

ARCHS = {"DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}
#: vLLM's --kv-cache-dtype -> the row format it asks for (None: the serving dtype's). vLLM names
#: DeepSeek-V3.2's 656-byte FP8 MLA row fp8_ds_mla; our fp8 rows are that row (e4m3 values).
CACHE_DTYPE_ROWS = {
    "auto": None,
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_ds_mla": "fp8",
    "bfloat16": "bf16",
}
MODEL_TYPES = {"deepseek_v32": "deepseek_v32", "glm_moe_dsa": "glm_moe_dsa"}


def _arch(hf: Any) -> str:
    model_type, archs = schema.raw(hf, "model_type"), schema.raw(hf, "architectures")
    arch = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if arch is None and isinstance(archs, (list, tuple)):
        arch = next((ARCHS[a] for a in archs if isinstance(a, str) and a in ARCHS), None)
    if arch is None:
        raise DSAConfigError(
            f"config.json: model_type {model_type!r} is neither deepseek_v32 nor glm_moe_dsa"
        )
    return arch


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _indexer_types(hf: Any, arch: str, layers: int) -> Tuple[str, ...]:
    """Per layer 'full' / 'shared'; a refusal names the key the kinds came from."""
    if arch == "deepseek_v32":  # transformers' DeepSeek-V3.2 runs every layer's indexer
        return ("full",) * layers
    types = schema.layer_list(hf, "indexer_types", ("full", "shared"), layers)
    pattern = schema.index_pattern(hf)
    if types is not None:
        if types[0] != "full":
            raise DSAConfigError(
                "config.json: indexer_types[0] must be 'full' (a shared layer reuses a full "
                f"one), got {types[0]!r}"
            )
        return types
    if pattern is not None:
        if len(pattern) != layers or pattern[0] != "F":
            raise DSAConfigError(
                f"config.json: index_topk_pattern must have one letter for each of the "
                f"{layers} layers, the first 'F' (a shared layer reuses a full one), "
                f"got {pattern!r}"
            )
        return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
    freq = schema.get(hf, "index_topk_freq")
    off = schema.get(hf, "index_skip_topk_offset")
    if freq > 1 and off < 1:  # layer 0 would be shared, with no full layer before it
        raise DSAConfigError(
            f"config.json: index_skip_topk_offset must be >= 1 when index_topk_freq ({freq}) "
            f"> 1 (layer 0 must run its indexer), got {off}"
        )
    return tuple("full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(layers))


def _check_row_sizes(hf: Any) -> None:
    """The rotary part is whole pairs and fits an index key; fp8 rows hold whole tiles."""
    rope_dim, key_dim = schema.get(hf, "qk_rope_head_dim"), schema.get(hf, "index_head_dim")
    if rope_dim is not None and rope_dim % 2:
        raise DSAConfigError(
            f"config.json: qk_rope_head_dim must be even (the rotary turns pairs), got {rope_dim}"
        )
    if rope_dim is not None and key_dim is not None and key_dim < rope_dim:
        raise DSAConfigError(
            f"config.json: index_head_dim must be >= qk_rope_head_dim ({rope_dim}, an index "
            f"key's rotary part), got {key_dim}"
        )
    latent = schema.get(hf, "kv_lora_rank")
    if schema.get(hf, ROW_FORMAT_KEY) == "fp8" and latent is not None and latent % rows.FP8_TILE:
        raise DSAConfigError(
            f"config.json: {ROW_FORMAT_KEY} 'fp8' needs kv_lora_rank to be a multiple of "
            f"{rows.FP8_TILE} (one scale per tile), got {latent}: use 'bf16' or 'f32'"
        )


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
    kv_lora_rank: int = rows.LATENT_DIM  # a row's latent values
    qk_rope_head_dim: int = rows.ROPE_DIM  # a row's (and an index key's) rotary values

    @staticmethod
    def from_hf(hf: Any) -> "DSAConfig":
        """The config of a dict (config.json) or a transformers / vLLM config object, checked
        against ``schema`` first: one ``DSAConfigError`` line naming the field otherwise."""
        arch = _arch(hf)
        schema.validate(hf, arch)
        _check_row_sizes(hf)
        layers = schema.need(hf, "num_hidden_layers")
        nope = schema.need(hf, "qk_nope_head_dim")
        rope_dim = schema.need(hf, "qk_rope_head_dim")
        rope = schema.rope(hf)
        scale = (nope + rope_dim) ** -0.5
        if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
            scale *= _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        interleave = schema.get(hf, "indexer_rope_interleave")
        return DSAConfig(
            arch=arch,
            num_layers=layers,
            hidden_size=schema.need(hf, "hidden_size"),
            num_heads=schema.need(hf, "num_attention_heads"),
            q_lora_rank=schema.need(hf, "q_lora_rank"),
            qk_nope_head_dim=nope,
            v_head_dim=schema.need(hf, "v_head_dim"),
            index_topk=schema.need(hf, "index_topk"),
            index_n_heads=schema.need(hf, "index_n_heads"),
            index_head_dim=schema.need(hf, "index_head_dim"),
            indexer_rope_interleave=(arch == "glm_moe_dsa") if interleave is None else interleave,
            indexer_types=_indexer_types(hf, arch, layers),
            softmax_scale=scale,
            rope=tuple(sorted(rope.items())),
            row_format=schema.get(hf, ROW_FORMAT_KEY),
            kv_lora_rank=schema.need(hf, "kv_lora_rank"),
            qk_rope_head_dim=rope_dim,
        )

    @property
    def kv_dim(self) -> int:
        """Values of one latent row: the latent, then the rotary part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def row_bytes(self, row_format: str) -> int:
        """Bytes of one row of this model in ``row_format`` (``rows.row_bytes``)."""
        return rows.row_bytes(row_format, self.kv_lora_rank, self.qk_rope_head_dim)

    def standard_rows(self) -> bool:
        """Whether rows have the released models' sizes (512 + 64), the only ones the CUDA
        row kernels and FlashMLA take; other sizes run the torch math."""
        return (self.kv_lora_rank, self.qk_rope_head_dim) == (rows.LATENT_DIM, rows.ROPE_DIM)

    def is_full(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"

    def leader(self, layer: int) -> int:
        """The full layer whose top-k ``layer`` uses (itself when full)."""
        while not self.is_full(layer):
            layer -= 1
        return layer

    def rope_parameters(self) -> dict:
        return dict(self.rope)

    def rope_positions(self) -> Optional[int]:
        """Positions a YaRN rope covers as vLLM tabulates it (original_max_position_embeddings
        x factor); None for a plain rope, which vLLM tabulates to max_position_embeddings."""
        rope = self.rope_parameters()
        if rope.get("rope_type") != "yarn":
            return None
        return int(rope["original_max_position_embeddings"] * rope["factor"])

    def check_context(self, max_len: int, flag: str) -> None:
        """A context of ``max_len`` (set by ``flag``) must fit the rope's table: vLLM's YaRN
        rope would otherwise index past it mid-request and bring the engine down."""
        limit = self.rope_positions()
        if limit is not None and max_len > limit:
            rope = self.rope_parameters()
            raise schema.DSAConfigError(
                f"{flag} {max_len} exceeds the {limit} positions of this checkpoint's YaRN rope "
                f"(config.json rope_parameters: original_max_position_embeddings "
                f"{rope['original_max_position_embeddings']} x factor {rope['factor']:g}): use "
                f"{flag} {limit} or less"
            )

    def row_format_for(self, dtype_name: str, cache_dtype: str = "auto") -> str:
        """The row format: the configured one (``hisparse_row_format``), else the one vLLM's
        ``--kv-cache-dtype`` names, else the unquantized one of the serving dtype; a cache dtype
        with no row format here, or one that disagrees with the configured format, is refused
        in one line naming the flag."""
        if cache_dtype not in CACHE_DTYPE_ROWS:
            known = ", ".join(CACHE_DTYPE_ROWS)
            raise DSAConfigError(
                f"--kv-cache-dtype {cache_dtype} has no latent row format here: use one of {known}"
            )
        asked = CACHE_DTYPE_ROWS[cache_dtype]
        if asked and self.row_format and asked != self.row_format:
            raise DSAConfigError(
                f"--kv-cache-dtype {cache_dtype} asks for {asked} rows, but config.json "
                f"{ROW_FORMAT_KEY} is {self.row_format!r}: drop one of them"
            )
        fmt = self.row_format or asked or ("f32" if dtype_name == "float32" else "bf16")
        if not rows.fits(fmt, self.kv_lora_rank):
            raise DSAConfigError(
                f"--kv-cache-dtype {cache_dtype}: fp8 rows need kv_lora_rank to be a multiple "
                f"of {rows.FP8_TILE}, this checkpoint's is {self.kv_lora_rank}: use auto"
            )
        return fmt
