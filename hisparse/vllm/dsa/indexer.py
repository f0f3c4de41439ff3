"""A full DSA layer's indexer in vLLM (``self_attn.indexer.*``): its weights, its key cache, and
the top-k slots of each token through ``hisparse.models.dsa.core``; with the vLLM rotary's
parameters and the plain linear layers the attention module shares."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.rotary_embedding import get_rope

from hisparse.models.dsa import indexer as dsa_index
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore
from hisparse.vllm.cache_layers import CacheLayer


def vllm_rope_parameters(cfg: DSAConfig) -> dict:
    """rope parameters as vLLM's DeepSeek rotary expects them (YaRN -> its deepseek_yarn)."""
    rope = cfg.rope_parameters()
    if rope["rope_type"] != "default":
        rope["rope_type"] = (
            "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"
        )
    return rope


def linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class DSAIndexer(nn.Module):
    """A full layer's indexer weights (``self_attn.indexer.*``) and its key cache."""

    def __init__(self, cfg: DSAConfig, cache_name: str, max_pos: int, core: SparseMLACore) -> None:
        super().__init__()
        self.cfg, self.core = cfg, core
        d, h = cfg.index_head_dim, cfg.index_n_heads
        self.wq_b = linear(cfg.q_lora_rank, h * d)
        self.wk = linear(cfg.hidden_size, d)
        self.k_norm = nn.LayerNorm(d, eps=dsa_index.KEY_NORM_EPS)
        self.weights_proj = linear(cfg.hidden_size, h)
        self.rotary_emb = get_rope(
            cfg.qk_rope_head_dim,
            max_position=max_pos,
            rope_parameters=vllm_rope_parameters(cfg),
            is_neox_style=not cfg.indexer_rope_interleave,
        )
        self.cache = CacheLayer(cache_name, core.key_bytes, torch.uint8, True)

    def select(self, h: torch.Tensor, q_resid: torch.Tensor, step: Any) -> torch.Tensor:
        """Store the new tokens' keys; the slots of each token's top-k positions, int64
        [T, index_topk] in ascending position order, -1 padding. ``step``: the forward's
        ``attention.Step``."""
        cfg = self.cfg
        t, d, r = h.shape[0], cfg.index_head_dim, cfg.qk_rope_head_dim
        q = self.wq_b(q_resid).view(t, cfg.index_n_heads, d)
        k = dsa_index.normalise_key(self.wk(h), self.k_norm.weight, self.k_norm.bias)
        q_pe, k_pe = self.rotary_emb.forward_native(
            step.positions, q[..., :r].contiguous(), k[:, None, :r].contiguous()
        )
        q = torch.cat([q_pe.view(t, -1, r), q[..., r:]], -1)
        k = torch.cat([k_pe.view(t, r), k[:, r:]], -1)
        cache = self.cache.blocks()
        self.core.store_keys(cache, step.meta.slot_mapping, k, step.tokens.block_size)
        return self.core.select(q, self.weights_proj(h), cache, step.tokens)
