"""The indexer's selection in torch over the paged index key cache: the core's path where no
kernel serves the key format or the device (the CPU), and the oracle of the kernels' tests."""

from __future__ import annotations

import torch

from hisparse.models.dsa import index_keys
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.indexer import causal_top_k, sorted_positions
from hisparse.models.dsa.tokens import TokenBatch


def positions(
    q, head_w, cache, batch: TokenBatch, cfg: DSAConfig, key_format: str, chunk_elems: int
) -> torch.Tensor:
    """Positions int64 [T, index_topk] each token attends to, ascending, -1 padding last: q [T,
    Hi, D] / head_w [T, Hi], ``cache`` the layer's paged keys in ``key_format``. Tokens are
    scored in chunks of at most ``chunk_elems`` scores per head."""
    step = max(1, chunk_elems // (cfg.index_n_heads * batch.max_context))
    parts = []
    for s in range(0, batch.num_tokens, step):
        b = batch.narrow(s, min(step, batch.num_tokens - s))
        found = scores(q[s : s + step], head_w[s : s + step], cache, b, cfg, key_format)
        parts.append(sorted_positions(top_k(found, b, cfg.index_topk), cfg.index_topk))
    return torch.cat(parts) if parts else batch.positions.new_zeros(0, cfg.index_topk)


def scores(q, head_w, cache, batch: TokenBatch, cfg: DSAConfig, key_format: str) -> torch.Tensor:
    """float32 [T, max_context] over each token's request's keys (any position)."""
    ctx = torch.arange(batch.max_context, device=q.device)
    bs = batch.block_size
    # Each request's keys are read once (a prefill's tokens share them), then handed to its
    # tokens: the same slots as batch.slots gives per token, so the same values.
    blk = batch.block_table[:, torch.div(ctx, bs, rounding_mode="floor")]
    per_req = index_keys.load_keys(
        cache, blk.long() * bs + ctx % bs, key_format, cfg.index_head_dim, bs
    )
    keys = per_req[batch.req]
    logits = torch.einsum("thd,tnd->thn", q.float(), keys) * cfg.index_head_dim**-0.5
    weights = head_w.float() * cfg.index_n_heads**-0.5
    return torch.einsum("th,thn->tn", weights, torch.relu(logits))


def top_k(found: torch.Tensor, batch: TokenBatch, k: int) -> torch.Tensor:
    """Positions int64 [T, <= k] of the best visible keys (-1 where too few)."""
    if found.device.type != "cpu":  # one ranking over the padded rows, no host sync
        key_pos = torch.arange(found.shape[1], device=found.device)
        return causal_top_k(found, key_pos, batch.positions, k)
    # The CPU: rank each token's own context (the request's seq_len keys), as transformers:
    # topk's choice among equal scores (ReLU zeros are common) depends on the row's length.
    lens = batch.seq_lens[batch.req]
    out = torch.full((batch.num_tokens, k), -1, dtype=torch.int64)
    for n in lens.unique().tolist():
        rows = (lens == n).nonzero().squeeze(1)
        sel = causal_top_k(found[rows, :n], torch.arange(n), batch.positions[rows], k)
        out[rows, : sel.shape[1]] = sel
    return out
