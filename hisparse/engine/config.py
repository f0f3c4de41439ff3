"""EngineConfig: everything that defines one reference workload (model shape, KV layout,
HiSparse sizes, batch, locality). Same config + same seed = same tokens, on any device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from hisparse.models.reference_config import ReferenceShape, check_fraction, check_model_fields
from hisparse.ops.limits import MAX_HOT_SIZE, check_int

RESIDENCIES = ("host", "hybrid")


@dataclass(frozen=True)
class EngineConfig(ReferenceShape):
    # model
    num_layers: int = 4  # decoder layers
    index_share: int = 2  # layers per index group (1 leader + index_share-1 followers)
    hidden: int = 64  # residual width
    vocab: int = 512
    indexer_dim: int = 32  # indexer key/query width (keys stay on the device)
    row_format: str = "fp8"  # "fp8" (656-B rows) or "bf16" (1152-B rows)
    dtype: str = "float64"  # compute dtype (float64: CPU and CUDA agree token for token)
    seed: int = 0
    # sparse attention / HiSparse
    top_k: int = 64
    hot_size: int = 128  # hot-buffer rows per request per layer (>= top_k)
    block_size: int = 16  # rows per block of the packed KV allocations
    # workload
    num_requests: int = 24
    max_running: int = 8  # state rows = max concurrently running requests
    prompt_len: int = 320
    output_len: int = 64
    length_jitter: float = 0.25  # request i's lengths are scaled by a seeded factor in [1-j, 1]
    # locality
    drift: float = 0.05  # indexer query EMA rate per token: 0 = frozen, 1 = no memory
    recent_window: int = 8  # the newest tokens are always selected (0 = none)
    # telemetry
    metrics_interval: int = 16  # engine steps between counter snapshots
    # residency of HiSparse runs (mode="hisparse"): "host" = every row in the host pool, hot
    # buffers for every request (always-host); "hybrid" = rows stay in device KV pages while they
    # fit, whole requests spill to the host pool under pressure and may come back (docs/engine.md)
    residency: str = "host"
    device_pages: int = 0  # hybrid: device KV pages of block_size rows (0 = every state
    # row at max context, i.e. nothing ever spills)
    hot_slots: int = -1  # hybrid: requests that can be spilled at once (hot buffers
    # allocated); -1 = max_running, 0 = none (no host pool)

    def __post_init__(self) -> None:
        check_model_fields(self)
        check_int("hot_size", self.hot_size, 1, MAX_HOT_SIZE)
        check_int("block_size", self.block_size, 1)
        check_int("num_requests", self.num_requests, 1)
        check_int("max_running", self.max_running, 1)
        check_int("prompt_len", self.prompt_len, 1)
        check_int("output_len", self.output_len, 1)
        check_int("metrics_interval", self.metrics_interval, 1)
        check_int("device_pages", self.device_pages, 0)
        check_int("hot_slots", self.hot_slots, -1, self.max_running)
        if self.residency not in RESIDENCIES:
            raise ValueError(f"residency must be one of {RESIDENCIES}, got {self.residency!r}")
        if self.hot_size < self.top_k:
            raise ValueError(f"hot_size ({self.hot_size}) must be >= top_k ({self.top_k})")
        check_fraction("length_jitter", self.length_jitter)
        if self.length_jitter >= 1.0:
            raise ValueError(f"length_jitter must be < 1, got {self.length_jitter!r}")
        if self.num_state_rows * self.max_context * 1 > 2**31 - 1:
            raise ValueError("max_running * max context must fit int32 keys")
        if self.num_state_rows * self.hot_size > 2**31 - 1:
            raise ValueError("max_running * hot_size must fit int32 rows")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def num_state_rows(self) -> int:
        return self.max_running

    @property
    def max_context(self) -> int:
        """Key rows reserved per state row: max prompt + output, rounded up to block_size."""
        c = self.prompt_len + self.output_len
        return -(-c // self.block_size) * self.block_size

    @property
    def pages_per_request(self) -> int:
        """Device pages one request needs at max context (hybrid)."""
        return self.max_context // self.block_size

    @property
    def num_device_pages(self) -> int:
        return self.device_pages or self.num_state_rows * self.pages_per_request

    @property
    def num_hot_slots(self) -> int:
        return self.max_running if self.hot_slots < 0 else self.hot_slots

    @property
    def num_keys(self) -> int:
        return self.num_state_rows * self.max_context


def request_lengths(cfg: EngineConfig) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(prompt lengths, output lengths) of every request: seeded, deterministic, >= 1."""
    import random

    rng = random.Random(cfg.seed * 1_000_003 + 17)
    prompts, outputs = [], []
    for _ in range(cfg.num_requests):
        fp = 1.0 - cfg.length_jitter * rng.random()
        fo = 1.0 - cfg.length_jitter * rng.random()
        prompts.append(max(1, int(round(cfg.prompt_len * fp))))
        outputs.append(max(1, int(round(cfg.output_len * fo))))
    return tuple(prompts), tuple(outputs)
