"""What a ``generate`` run keeps on the device for its requests' KV, by mode, and how a fixed
device KV budget is spent: the accounting behind ``benchmarks/bench_engine.py``.

Per run of ``c`` requests whose contexts round up to ``context`` rows (``context_rows``), over
``L`` layers of ``row_bytes`` rows, ``F`` full (indexer) layers of ``key_bytes`` index keys:

* resident: ``c x context x L`` rows (``stores.ResidentRows``);
* hisparse: ``c x hot_size x L`` hot rows (``stores.HiSparseRows``; the rows live in the host
  pool);
* hybrid: ``(device_blocks x BLOCK + hot_slots x hot_size) x L`` rows: the pages, then the hot
  buffers ``hybrid.HybridRows`` keeps for spilled requests (``hybrid_split`` spends a budget);
* every mode: ``c x context x F`` index keys (they stay on the device).

Weights, activations, the host pool and the connector's per-row metadata are not counted.
``held`` reads the same off a run's buffers, so a benchmark can check the formula against them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse.engine.dsa.stores import BLOCK, ResidentRows
from hisparse.models.dsa import index_keys
from hisparse.models.dsa.config import DSAConfig


def context_rows(tokens: int) -> int:
    """Rows a request of ``tokens`` tokens (prompt + new) is given: whole blocks."""
    return -(-tokens // BLOCK) * BLOCK


@dataclass(frozen=True)
class DeviceKV:
    """Device KV bytes of runs of one shape (see the module docstring)."""

    layers: int
    full_layers: int
    row_bytes: int
    key_bytes: int
    context: int
    hot_size: int

    @classmethod
    def of(cls, cfg: DSAConfig, row_format: str, context: int, hot_size: int, key_format=None):
        kf = key_format or index_keys.default_format(row_format)
        full = sum(cfg.is_full(i) for i in range(cfg.num_layers))
        kb = index_keys.key_bytes(kf, cfg.index_head_dim)
        rb = cfg.row_bytes(row_format)
        return cls(cfg.num_layers, full, rb, kb, context, hot_size)

    @property
    def block_bytes(self) -> int:
        """One hybrid device block: ``BLOCK`` rows in every layer."""
        return BLOCK * self.layers * self.row_bytes

    def keys(self, c: int) -> int:
        return c * self.context * self.full_layers * self.key_bytes

    def rows(self, mode: str, c: int, device_blocks: int = 0, hot_slots=None) -> int:
        """``hot_slots``: hybrid's hot buffers (default ``c``)."""
        per_row = self.layers * self.row_bytes
        if mode == "resident":
            return c * self.context * per_row
        if mode != "hybrid":
            return c * self.hot_size * per_row
        return (device_blocks * BLOCK + (hot_slots or c) * self.hot_size) * per_row

    def total(self, mode: str, c: int, device_blocks: int = 0, hot_slots=None) -> int:
        return self.rows(mode, c, device_blocks, hot_slots) + self.keys(c)

    def capacity(self, mode: str, budget: int) -> int:
        """The most requests ``mode`` runs within ``budget`` bytes (hybrid: with one block)."""
        spare = budget - (self.block_bytes if mode == "hybrid" else 0)
        return max(0, spare // self.total("hisparse" if mode == "hybrid" else mode, 1))

    def hybrid_split(self, c: int, budget: int) -> tuple:
        """(device blocks, hot slots) for hybrid at ``c`` requests: the fewest hot buffers
        (at least one) whose remaining blocks hold the other requests' whole contexts with a
        page of headroom each, so no more are ever spilled at once than there are hot
        buffers (``residency``'s rules); (0, c) where not even one block fits."""
        pages = self.context // BLOCK
        for h in range(1, c + 1):
            blocks = (budget - self.total("hybrid", c, 0, h)) // self.block_bytes
            if blocks >= max(1, (c - h) * (pages + 1)):
                return blocks, h
        return 0, c


def held(store, fwd) -> dict:
    """Bytes a run's store and forward pass hold on the device: ``rows`` (resident rows, or
    every registered connector buffer: hot rows, and hybrid's pages) and ``index_keys``."""
    if isinstance(store, ResidentRows):
        bufs = store.rows
    else:
        bufs = [store.worker.hot_rows(n) for n in store.names]
    keys = [k for k in fwd.index_keys if k is not None]
    return dict(rows=sum(b.nbytes for b in bufs), index_keys=sum(k.nbytes for k in keys))
