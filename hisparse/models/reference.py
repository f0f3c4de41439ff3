"""The reference sparse-MLA decoder's weights and per-layer math (no storage, no scheduling).

Everything here is a pure function of its inputs, so the resident and the HiSparse run compute
bit-identical results whenever attention is handed the same row bytes in the same order.
"""

from __future__ import annotations

import math
from typing import List

import torch

from hisparse.models.rows import KV_DIM, LATENT_DIM, ROPE_DIM

NEG_INF = float("-inf")


def _dtype(cfg) -> torch.dtype:
    return torch.float64 if cfg.dtype == "float64" else torch.float32


class Model:
    """Weights drawn from ``cfg.seed`` on the CPU (float64), then cast and moved to ``device``.

    ``cfg`` is a ``ReferenceConfig`` or anything with its fields (the engine's config has them).
    """

    def __init__(self, cfg, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dt = _dtype(cfg)
        g = torch.Generator().manual_seed(cfg.seed)
        d, di = cfg.hidden, cfg.indexer_dim

        def w(*shape, scale):
            t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
            return t.to(dtype=dt).to(device)

        self.emb = w(cfg.vocab, d, scale=1.0)
        self.layers: List[dict] = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                dict(
                    w_dkv=w(d, LATENT_DIM, scale=1.0 / math.sqrt(d)),
                    w_kr=w(d, ROPE_DIM, scale=1.0 / math.sqrt(d)),
                    w_uq=w(d, LATENT_DIM, scale=1.0 / math.sqrt(d)),
                    w_qr=w(d, ROPE_DIM, scale=1.0 / math.sqrt(d)),
                    w_o=w(LATENT_DIM, d, scale=1.0 / math.sqrt(LATENT_DIM)),
                    w_1=w(d, 2 * d, scale=1.0 / math.sqrt(d)),
                    w_2=w(2 * d, d, scale=0.5 / math.sqrt(2 * d)),
                )
            )
        self.indexers: List[dict] = []
        for _ in range(cfg.num_groups):
            self.indexers.append(
                dict(
                    w_ik=w(d, di, scale=1.0 / math.sqrt(d)),
                    w_iq=w(d, di, scale=1.0 / math.sqrt(d)),
                )
            )
        self.head = w(d, cfg.vocab, scale=1.0 / math.sqrt(d))
        # A positional term in every indexer key: a repeated token must not score (nearly) the
        # same as its earlier copies, or the top-k boundary would be decided by rounding noise,
        # which differs between devices.
        self.index_pos = w(cfg.max_context, di, scale=0.5)
        half = ROPE_DIM // 2
        inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
        self.inv_freq = inv.to(dtype=dt).to(device)
        self.scale = 1.0 / math.sqrt(KV_DIM)

    # ---- pieces ----------------------------------------------------------------------------
    @staticmethod
    def rmsnorm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate pairs of x [..., 64] by position pos [...] (int64)."""
        ang = pos.to(self.dtype).unsqueeze(-1) * self.inv_freq
        c, s = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb[tokens]

    def project(self, x: torch.Tensor, layer: int, pos: torch.Tensor):
        """Normalised input h, the new token's KV values [.., 576] and its query [.., 576]."""
        p = self.layers[layer]
        h = self.rmsnorm(x)
        kv = torch.cat([h @ p["w_dkv"], self.rope(h @ p["w_kr"], pos)], dim=-1)
        q = torch.cat([h @ p["w_uq"], self.rope(h @ p["w_qr"], pos)], dim=-1)
        return h, kv, q

    def index_key(self, h: torch.Tensor, group: int, pos: torch.Tensor) -> torch.Tensor:
        return h @ self.indexers[group]["w_ik"] + self.index_pos[pos]

    def index_query(self, h: torch.Tensor, group: int) -> torch.Tensor:
        return h @ self.indexers[group]["w_iq"]

    def attend(self, q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q [N, 576], kv [N, K, 576] (decoded rows), valid [N, K] -> o [N, 512]."""
        scores = torch.einsum("nd,nkd->nk", q, kv) * self.scale
        scores = scores.masked_fill(~valid, NEG_INF)
        p = torch.softmax(scores, dim=-1)
        return torch.einsum("nk,nkd->nd", p, kv[..., :LATENT_DIM])

    def finish_layer(self, x: torch.Tensor, o: torch.Tensor, layer: int) -> torch.Tensor:
        p = self.layers[layer]
        x = x + o @ p["w_o"]
        return x + torch.nn.functional.gelu(self.rmsnorm(x) @ p["w_1"]) @ p["w_2"]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.rmsnorm(x) @ self.head


def select_top_k(
    scores: torch.Tensor, num_valid: torch.Tensor, k: int, recent: int
) -> torch.Tensor:
    """Top-k positions per row, sorted ascending, padded with -1.

    scores [N, T]: indexer scores of positions 0..T-1; num_valid [N]: row n may select positions
    < num_valid[n] (its current position + 1); the newest ``recent`` valid positions are always
    selected. Returns int64 [N, k].
    """
    N, T = scores.shape
    pos = torch.arange(T, device=scores.device)
    nv = num_valid.unsqueeze(-1)
    s = scores.masked_fill(pos >= nv, NEG_INF)
    if recent > 0:
        s = s.masked_fill((pos < nv) & (pos >= nv - recent), float("inf"))
    kk = min(k, T)
    # Equal scores (a repeated token has the same indexer key) must be broken the same way on
    # every device -- the lower position wins, as a stable sort would. topk's values do not
    # depend on how it breaks ties, so: everything above the k-th largest value, then the lowest
    # positions equal to it: the set a stable descending sort's first k would give, without
    # ordering all T scores of every row (the prefill runs this over [2048, 8k] chunks).
    thr = torch.topk(s, kk, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    gt = s > thr
    eq = s == thr
    take = gt | (eq & (eq.cumsum(dim=-1) <= kk - gt.sum(dim=-1, keepdim=True)))
    take &= s != NEG_INF  # selected only for lack of valid positions: padding
    cand = torch.where(take, pos, torch.full_like(pos, T))
    idx = torch.topk(cand, kk, dim=-1, largest=False, sorted=True).values
    idx = torch.where(idx >= T, torch.full_like(idx, -1), idx)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((N, k - kk), -1)], dim=-1)
    return idx


def ema_matrix(n: int, drift: float, dtype, device) -> torch.Tensor:
    """[n, n] lower-triangular weights of the EMA q_i = (1-a) q_{i-1} + a u_i, q_{-1} = u_0.

    Row i: weights over u_0..u_i (they sum to 1)."""
    a = float(drift)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    w = a * (1.0 - a) ** (i - j)
    w = torch.where(j <= i, w, torch.zeros_like(w))
    w[:, 0] = (1.0 - a) ** i.squeeze(1)  # u_0 also seeds the state
    return w.to(dtype=dtype, device=device)
