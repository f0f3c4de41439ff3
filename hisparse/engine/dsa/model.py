"""One forward step of a DSA checkpoint (DeepSeek-V3.2 / GLM-5) for a batch of requests over a
row store: decodes (one token each) first, then prefill tokens, in one pass per layer.

The layer's sparse attention is ``hisparse.models.dsa.core`` (the code the vLLM classes run);
this module adds the decoder around it from ``hisparse.models.dsa`` (norms, rotary, MLP / MoE)
and the request bookkeeping. Per layer the new tokens' latent rows are saved to the store in the
row format, their index keys to the layer's key cache, the top-k comes from the layer's own
indexer (full layers) or its index-group leader's (shared layers), and attention decodes exactly
the bytes the store hands back. Request b's tokens have slots ``block[b] * max_context +
position`` (one block of ``max_context`` per request).

``observe`` is a test seam, off unless its block is active: the parity eval (``evals/parity``)
records every layer's attention output and the final hidden states through it, to compare two
runs bit for bit beyond their tokens.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from hisparse.models.dsa.core import CHUNK_ELEMS, SparseMLACore, TokenBatch
from hisparse.models.dsa.decoder import Rotary, linear, mlp, moe
from hisparse.models.dsa.projections import index_inputs, mla_query, mla_row, norm
from hisparse.models.dsa.weights import Checkpoint


@dataclass(frozen=True)
class Decodes:
    """A step's leading decode rows: ``rows`` requests with ``tokens`` query tokens in all, at
    most ``q`` each (a speculative verify: the pending token and its draft). ``at``: each decode
    token's slice of its request's union row (``union.decode_token_rows``), None when ``q`` is
    1; the store then resolves one row of q x top-k keys per request (``HiSparseRows``)."""

    rows: int
    tokens: int
    q: int = 1
    at: Optional[torch.Tensor] = None


_OBSERVER: ContextVar = ContextVar("hisparse_dsa_step_observer", default=None)


@contextlib.contextmanager
def observe(observer):
    """While the block is active every ``DSAForward.step`` calls ``observer.layer(i, out)`` with
    layer i's attention output (after ``o_proj``, every token of the step in batch order) and
    ``observer.final(hidden)`` with the final hidden state of each request's sampled token.
    Eager steps only: a replayed CUDA graph calls nothing (``generate(graphs=False)``)."""
    token = _OBSERVER.set(observer)
    try:
        yield observer
    finally:
        _OBSERVER.reset(token)


def _observer():
    obs = _OBSERVER.get()
    if obs is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("observe(): a CUDA graph capture records nothing; run eagerly")
    return obs


def as_decodes(decodes: Union[int, Decodes]) -> Decodes:
    """``decodes`` as a ``Decodes`` (an int: that many one-token decodes)."""
    return decodes if isinstance(decodes, Decodes) else Decodes(decodes, decodes)


class DSAForward:
    """The checkpoint's forward pass on ``device`` for up to ``max_requests`` requests of up to
    ``max_context`` tokens, with rows in ``row_format`` and index keys in ``key_format``."""

    def __init__(
        self,
        ck: Checkpoint,
        row_format: str,
        device: torch.device,
        *,
        max_requests: int = 1,
        max_context: int,
        key_format: Optional[str] = None,
        backend: str = "auto",
        attention: str = "auto",
        misses: str = "auto",
    ) -> None:
        self.ck, self.cfg, self.spec = ck, ck.cfg, ck.spec
        self.row_format, self.device = row_format, device
        self.max_context = max_context
        self.core = SparseMLACore(
            ck.cfg, row_format, device, key_format=key_format, backend=backend,
            attention=attention, misses=misses,
        )  # fmt: skip
        self.rotary = Rotary(ck.cfg, ck.spec.max_positions, device)
        self.index_keys: List[Optional[torch.Tensor]] = [
            self.core.key_cache(max_requests, max_context, device) if self.cfg.is_full(i) else None
            for i in range(self.cfg.num_layers)
        ]

    def batch(
        self, positions: torch.Tensor, req: torch.Tensor, seq_lens: torch.Tensor, blocks
    ) -> TokenBatch:
        """The tokens of a step, all on the device: ``blocks`` int [R] is each request's block."""
        return TokenBatch(positions, req, seq_lens, blocks.view(-1, 1), self.max_context)

    @torch.no_grad()
    def step(
        self,
        store,
        tokens: torch.Tensor,
        batch: TokenBatch,
        last: torch.Tensor,
        num_decodes: int,
    ) -> torch.Tensor:
        """Run ``tokens`` (int64 [T]; rows ``batch``; the first ``num_decodes`` are one-token
        decodes); logits float [R, vocab] of each request's token ``last[r]``."""
        slots = batch.slots(batch.positions.view(-1, 1)).view(-1)
        rope = self.rotary(batch.positions)
        x = self.ck.embed[tokens]
        sel, obs = None, _observer()
        eps, fused = self.spec.rms_norm_eps, self.core.kernel_rows
        dense = self.device.type == "cuda"  # the MoE without host reads: capturable
        for i in range(self.cfg.num_layers):
            h = norm(x, self.ck.norms[i]["input_layernorm.weight"], eps, kernels=fused)
            o, sel = self._attention(i, h, rope, store, batch, slots, num_decodes, sel)
            if obs is not None:
                obs.layer(i, o)
            x = x + o
            post = self.ck.norms[i]["post_attention_layernorm.weight"]
            h = norm(x, post, eps, kernels=fused)
            w = self.ck.ffn[i]
            x = x + (mlp(h, w) if self.spec.dense[i] else moe(h, w, self.spec, dense=dense))
        out = norm(x[last], self.ck.norm, eps, kernels=fused)
        if obs is not None:
            obs.final(out)
        return linear(out, self.ck.lm_head)

    def _attention(self, i: int, h, rope, store, batch: TokenBatch, slots, nd, sel):
        """``nd``: the leading decodes, an int (one token each) or a ``Decodes``."""
        cfg, w, core = self.cfg, self.ck.attn[i], self.core
        d = as_decodes(nd)
        fused = core.kernel_rows
        q_resid, row = mla_row(h, w, cfg, rope, kernels=fused)
        store.save(i, core.encode_rows(row), slots)
        if cfg.is_full(i):
            q, k, head_w = index_inputs(h, q_resid, w, cfg, rope, kernels=fused)
            core.store_keys(self.index_keys[i], slots, k, batch.block_size)
            sel = core.select(q, head_w, self.index_keys[i], batch)
        kv_b = w["kv_b_proj.weight"]
        td = d.tokens
        heads = {}

        def queries() -> None:  # attention alone reads them: made while the misses copy in
            heads["nope"], heads["pe"] = mla_query(q_resid, w, cfg, rope, kernels=fused)
            if td:
                heads["decode"] = core.query(heads["nope"][:td], heads["pe"][:td], kv_b)

        parts = []
        if td:
            keys, defer = sel[:td], core.reads_misses(td)
            # One-token decodes pass no Decodes (their graph path).
            extra = (d,) if d.q > 1 else ()
            src, ids, misses = store.decode_rows(i, keys, defer, *extra, beside=queries)
            parts.append(core.attend_query(heads["decode"], kv_b, src, ids, misses))
        else:
            queries()
        q_nope, q_pe = heads["nope"], heads["pe"]
        # Prefill tokens in chunks: their rows [T, K, kv_dim] would not fit at once. Each token's
        # math is its own: chunks change no value, and both modes chunk alike.
        n = max(1, CHUNK_ELEMS // (cfg.index_topk * cfg.kv_dim))
        for s in range(td, sel.shape[0], n):
            src, ids = store.prefill_rows(i, sel[s : s + n])
            parts.append(core.attend(q_nope[s : s + n], q_pe[s : s + n], kv_b, src, ids))
        values = parts[0] if len(parts) == 1 else torch.cat(parts)
        return linear(values, w["o_proj.weight"]), sel
