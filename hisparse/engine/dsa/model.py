"""One forward step of a DSA checkpoint (DeepSeek-V3.2 / GLM-5) for one request, over a row store.

The math is ``hisparse.models.dsa`` (shared with the vLLM classes); this module only orders it:
per layer the new tokens' latent rows are encoded in the row format and saved to the store, the
layer's top-k comes from its own indexer (full layers) or its index-group leader's (shared
layers), and attention decodes exactly the bytes the store reads back.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from hisparse.models.dsa.decoder import Rotary, linear, mlp, moe, rms_norm
from hisparse.models.dsa.projections import (
    attention_output,
    index_inputs,
    mla_inputs,
    select_sorted,
)
from hisparse.models.dsa.weights import Checkpoint
from hisparse.models.rows import KV_DIM, decode_rows, encode_rows

#: Bound on one chunk's gathered row values / index scores (elements).
CHUNK_ELEMS = 1 << 24


class RequestState:
    """A request's index keys (one [max_context, index_head_dim] cache per full layer)."""

    def __init__(self, ck: Checkpoint, max_context: int, device: torch.device) -> None:
        cfg = ck.cfg
        self.index_keys: List[Optional[torch.Tensor]] = [
            torch.zeros(max_context, cfg.index_head_dim, device=device) if cfg.is_full(i) else None
            for i in range(cfg.num_layers)
        ]


class DSAForward:
    """The checkpoint's forward pass in float32 on ``device`` with rows in ``row_format``."""

    def __init__(self, ck: Checkpoint, row_format: str, device: torch.device) -> None:
        self.ck, self.cfg, self.spec = ck, ck.cfg, ck.spec
        self.row_format, self.device = row_format, device
        self.rotary = Rotary(ck.cfg, ck.spec.max_positions, device)

    @torch.no_grad()
    def step(self, store, req: RequestState, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Run ``tokens`` (int64 [T] at positions start..start+T-1); the last token's logits."""
        self._end = start + tokens.numel()  # keys visible to this step (no device sync)
        pos = torch.arange(start, self._end, device=self.device)
        rope = self.rotary(pos)
        base = store.state_row * store.max_context
        x = self.ck.embed[tokens]
        sel = None
        for i in range(self.cfg.num_layers):
            h = rms_norm(x, self.ck.norms[i]["input_layernorm.weight"], self.spec.rms_norm_eps)
            o, sel = self._attention(i, h, pos, rope, store, req, base, sel)
            x = x + o
            norm = self.ck.norms[i]["post_attention_layernorm.weight"]
            h = rms_norm(x, norm, self.spec.rms_norm_eps)
            w = self.ck.ffn[i]
            x = x + (mlp(h, w) if self.spec.dense[i] else moe(h, w, self.spec))
        last = rms_norm(x[-1:], self.ck.norm, self.spec.rms_norm_eps)
        return linear(last, self.ck.lm_head)[0]

    def _attention(self, i: int, h, pos, rope, store, req: RequestState, base: int, sel):
        cfg, w = self.cfg, self.ck.attn[i]
        q_resid, q_nope, q_pe, row = mla_inputs(h, w, cfg, rope)
        store.save(i, encode_rows(row, self.row_format), base + pos)
        if cfg.is_full(i):
            q, k, head_w = index_inputs(h, q_resid, w, cfg, rope)
            req.index_keys[i][pos] = k
        # Query tokens in chunks: a long prompt's index scores [T, heads, context] and rows
        # [T, K, 576] would not fit at once. Each query token's math is its own: chunks change
        # no value, and both modes chunk alike.
        per_token = max(cfg.index_topk * KV_DIM, cfg.index_n_heads * self._end)
        step = max(1, CHUNK_ELEMS // per_token)
        outs, sels = [], []
        for s in range(0, h.shape[0], step):
            c = slice(s, s + step)
            if cfg.is_full(i):
                keys = req.index_keys[i][: self._end]
                sel_c = select_sorted(q[c], head_w[c], keys, pos[c], cfg)
            else:
                sel_c = sel[c]  # the index-group leader's top-k
            outs.append(self._over_rows(i, store, q_nope[c], q_pe[c], sel_c, base, h.shape[0] > 1))
            sels.append(sel_c)
        return torch.cat(outs), torch.cat(sels)

    def _over_rows(self, i: int, store, q_nope, q_pe, sel, base: int, prefill: bool):
        valid = sel >= 0
        got = store.read(i, torch.where(valid, base + sel, sel), prefill=prefill)
        # Padding entries may read any row: zero them so no NaN byte pattern reaches softmax.
        got = torch.where(valid.unsqueeze(-1), got, torch.zeros_like(got))
        values = decode_rows(got, self.row_format, torch.float32)
        return attention_output(q_nope, q_pe, values, valid, self.ck.attn[i], self.cfg)
