"""KV state shared by every mode of the GPU-bound decode step, built once per run.

Per layer:
* `idx_keys[l]`  [max_batch, ctx, idx_dim] float8_e4m3fn and `idx_scales[l]` [max_batch, ctx]
  float32 on the device: the DSA indexer cache as DeepSeek-V3.2 keeps it (132 B per token: FP8
  key, one scale), which stays on the device in every mode (the indexer reads the whole context
  each step);
* `dev_rows[l]`  uint8 [max_batch * ctx, 656] on the device: the resident rows (request b's
  context at rows b*ctx ...);
* `host_views[l]` uint8 [max_batch * ctx, 656] in one pinned host pool, layer-major: request b's
  context is the contiguous host region b*ctx ... (misses come from the request's own region).

The resident and host regions hold the same bytes, so every mode reads identical rows. Hot
buffers are not shared: each `DecodeStep` owns its own (steps of several modes run interleaved,
and a hot row written by one would be stale to another's residency state). The capacity figures
count what each mode would need (`config.MemoryBudget`), not these shared allocations.
"""

from __future__ import annotations

import torch

from hisparse.engine.graph.config import ROW_BYTES, GraphConfig
from hisparse.models.rows import FP8_MAX, encode_rows
from hisparse.runtime.host_pool import HostPool, HostPoolError

# Requests' rows repeat a per-layer template of this many distinct rows at per-request offsets
# (encoding 128k x 576 values per layer on the device would only cost setup time).
TEMPLATE_ROWS = 16384
HOT_POISON = 0x55  # hot rows nothing gathered yet: a read of one shows up as a parity failure


class _RawPool:
    """A pinned allocation made directly, for machines whose MemAvailable reads low at start
    (microVMs whose memory grows as it is used) so that HostPool's check refuses it."""

    def __init__(self, n: int, pin: bool) -> None:
        self.raw = torch.empty(n, dtype=torch.uint8, pin_memory=pin)

    def release(self) -> None:
        self.raw = torch.empty(0, dtype=torch.uint8)


def _host_pool(n: int, pin: bool):
    try:
        return HostPool(n, pin=pin, what="graph engine host pool")
    except HostPoolError:
        return _RawPool(n, pin)


def _fp8_keys(B: int, ctx: int, dim: int, g: torch.Generator, device) -> tuple:
    """Random indexer keys quantized per token: (fp8 [B, ctx, dim], float32 scales [B, ctx])."""
    keys = torch.empty(B, ctx, dim, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(B, ctx, dtype=torch.float32, device=device)
    for b in range(B):  # one request at a time: the float32 draw of all of them would not fit
        k = torch.randn(ctx, dim, generator=g, device=device)
        s = k.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
        keys[b] = (k / s[:, None]).to(torch.float8_e4m3fn)
        scales[b] = s
    return keys, scales


class KVStore:
    def __init__(self, cfg: GraphConfig, max_batch: int, device) -> None:
        cfg.check()
        self.cfg, self.max_batch = cfg, max_batch
        self.device = torch.device(device)
        B, ctx = max_batch, cfg.ctx_len
        on_cuda = self.device.type == "cuda"
        layer_bytes = B * ctx * ROW_BYTES
        self.pool = _host_pool(layer_bytes * cfg.layers, on_cuda)
        g = torch.Generator(device=self.device).manual_seed(cfg.seed + 1)
        self.idx_keys, self.idx_scales, self.dev_rows, self.host_views = [], [], [], []
        for layer in range(cfg.layers):
            keys, scales = _fp8_keys(B, ctx, cfg.idx_dim, g, self.device)
            self.idx_keys.append(keys)
            self.idx_scales.append(scales)
            rows = torch.empty(B * ctx, ROW_BYTES, dtype=torch.uint8, device=self.device)
            host = self.pool.raw[layer * layer_bytes : (layer + 1) * layer_bytes]
            host = host.view(B * ctx, ROW_BYTES)
            self._fill(rows, host, g)
            self.dev_rows.append(rows)
            self.host_views.append(host)
        if on_cuda:
            torch.cuda.synchronize(self.device)

    def _fill(self, rows: torch.Tensor, host: torch.Tensor, g: torch.Generator) -> None:
        """Same bytes into the resident region and the host region, a few requests at a time."""
        cfg, ctx = self.cfg, self.cfg.ctx_len
        n_t = min(TEMPLATE_ROWS, ctx)
        kv = torch.randn(n_t, cfg.kv_dim, generator=g, device=self.device)
        template = encode_rows(kv, "fp8")
        pos = torch.arange(ctx, device=self.device)
        chunk = max(1, (1 << 28) // (ctx * ROW_BYTES))  # ~256 MiB of rows per copy
        for b0 in range(0, self.max_batch, chunk):
            b1 = min(self.max_batch, b0 + chunk)
            offs = torch.arange(b0, b1, device=self.device)[:, None] * 7919
            part = template[((pos[None, :] + offs) % n_t).reshape(-1)]
            rows[b0 * ctx : b1 * ctx].copy_(part)
            host[b0 * ctx : b1 * ctx].copy_(part)

    def release(self) -> None:
        self.idx_keys.clear()
        self.idx_scales.clear()
        self.dev_rows.clear()
        self.host_views.clear()
        self.pool.release()
