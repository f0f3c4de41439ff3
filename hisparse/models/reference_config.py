"""The reference sparse-MLA model's shape: its settings, their checks, and the layer/group
arithmetic that the model, the engine and the vLLM class all use.

``ReferenceShape`` holds the arithmetic over ``num_layers``, ``index_share`` and ``row_format``;
``ReferenceConfig`` is the model alone (what an exported checkpoint stores). The engine's own
config carries the same fields plus a workload and shares both the arithmetic and the checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

from hisparse.models.rows import ROW_FORMATS
from hisparse.ops.limits import MAX_HOT_SIZE, check_int

DTYPES = ("float64", "float32")
#: The settings that define a model (the rest of an engine config describes a workload).
MODEL_FIELDS = (
    "num_layers",
    "index_share",
    "hidden",
    "vocab",
    "indexer_dim",
    "row_format",
    "seed",
    "top_k",
    "recent_window",
    "drift",
)


class ReferenceShape:
    """Layer and index-group arithmetic of a config with ``num_layers``, ``index_share`` and
    ``row_format``."""

    num_layers: int
    index_share: int
    row_format: str

    @property
    def row_bytes(self) -> int:
        return ROW_FORMATS[self.row_format].row_bytes

    @property
    def num_groups(self) -> int:
        return -(-self.num_layers // self.index_share)

    def layer_names(self) -> Tuple[str, ...]:
        return tuple(f"model.layers.{i}.self_attn" for i in range(self.num_layers))

    def group_of(self, layer: int) -> int:
        return layer // self.index_share

    def is_leader(self, layer: int) -> bool:
        return layer % self.index_share == 0

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_model_fields(cfg) -> None:
    """Raise ValueError naming the first model setting of ``cfg`` that is out of range."""
    check_int("num_layers", cfg.num_layers, 1, 1024)
    check_int("index_share", cfg.index_share, 1, 1024)
    check_int("hidden", cfg.hidden, 1)
    check_int("vocab", cfg.vocab, 2)
    check_int("indexer_dim", cfg.indexer_dim, 1)
    check_int("seed", cfg.seed, 0)
    check_int("top_k", cfg.top_k, 1, MAX_HOT_SIZE)
    check_int("recent_window", cfg.recent_window, 0)
    if cfg.row_format not in ROW_FORMATS:
        raise ValueError(f"row_format must be one of {sorted(ROW_FORMATS)}, got {cfg.row_format!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    if cfg.recent_window > cfg.top_k:
        raise ValueError(f"recent_window ({cfg.recent_window}) must be <= top_k ({cfg.top_k})")
    check_fraction("drift", cfg.drift)


def check_fraction(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0 or v != v:
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")


@dataclass(frozen=True)
class ReferenceConfig(ReferenceShape):
    """The reference model alone: what `hisparse export-model` writes and the vLLM class reads.
    Defaults are the engine's."""

    num_layers: int = 4
    index_share: int = 2
    hidden: int = 64
    vocab: int = 512
    indexer_dim: int = 32
    row_format: str = "fp8"
    seed: int = 0
    top_k: int = 64
    recent_window: int = 8
    drift: float = 0.05
    dtype: str = "float32"
    max_context: int = 2048  # positions the model serves (its index-position table)

    def __post_init__(self) -> None:
        check_model_fields(self)
        check_int("max_context", self.max_context, 2)
