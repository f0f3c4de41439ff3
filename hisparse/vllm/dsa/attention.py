"""One DSA decoder layer's attention in vLLM: MLA over latent rows plus (full layers) the
indexer, with weights named as in the transformers checkpoint.

The sparse attention itself is ``hisparse.models.dsa.core`` (batched, device tensors only; Triton
kernels on CUDA for fp8 rows and keys); this module is the vLLM adapter around it. Rows go where
the step says: the layer's vLLM KV cache (all-resident) or the HiSparse connector (saved to the
host pool; decode rows resolved into the hot buffer by the index-group leader, a speculative
decode's tokens as one row of their top-k (``union``), prefill rows gathered from the host
pool). Both modes attend over the same row bytes through the same call.

Tensor parallel: each rank holds 1/TP of the heads (``q_b_proj`` / ``kv_b_proj`` rows,
``o_proj`` columns; the partial outputs are summed across ranks); the latent rows and the
indexer are computed whole on every rank, so every rank's rows are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope

from hisparse.models.dsa import attention as mla
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import CHUNK_ELEMS, SparseMLACore, TokenBatch
from hisparse.models.dsa.kernels import flashmla
from hisparse.models.dsa.union import token_ids, union_rows
from hisparse.vllm.cache_layers import CacheLayer
from hisparse.vllm.compat import tensor_parallel_peers
from hisparse.vllm.dsa.indexer import DSAIndexer, linear, vllm_rope_parameters


@dataclass
class Step:
    """What every layer of one forward shares: vLLM's metadata, the tokens as the core reads
    them, the connector and (HiSparse decodes) the decode rows' state rows and, for decodes of
    several tokens, each token's slice of its row (``union.decode_token_rows``)."""

    meta: Any  # hisparse.vllm.step_metadata.StepMetadata
    tokens: TokenBatch
    connector: Any = None
    state_rows: Optional[torch.Tensor] = None
    decode_at: Optional[torch.Tensor] = None

    @property
    def positions(self) -> torch.Tensor:
        return self.tokens.positions


# A CUDA vLLM ships FlashMLA's ops: the core measures them against its own kernels first.
flashmla.add_source("vllm.v1.attention.ops.flashmla")

# The rotary embeddings are called through ``forward_native``: vLLM 0.32's CPU kernel
# (``forward_cpu``) rotates a [T, H, 64] query wrongly when the key has one head.


def _tp() -> tuple:
    """(rank, size) of the tensor-parallel group; (0, 1) outside one."""
    peers = tensor_parallel_peers()
    return (peers.rank, peers.world_size) if peers is not None else (0, 1)


def _head_shard(n_in: int, n_out: int, dim: int, tp: tuple) -> nn.Linear:
    """This rank's part of a head-major weight: 1/TP of its rows (``dim`` 0) or columns (1).
    Plain ``nn.Linear`` (not vLLM's parallel layers): MLA reads ``kv_b_proj.weight`` itself."""
    rank, size = tp
    lin = linear(n_in // size if dim == 1 else n_in, n_out // size if dim == 0 else n_out)
    if size > 1:
        lin.weight.weight_loader = partial(_load_shard, dim=dim, rank=rank)
    return lin


def _load_shard(param: torch.Tensor, w: torch.Tensor, *, dim: int, rank: int) -> None:
    n = param.shape[dim]
    param.data.copy_(w.narrow(dim, rank * n, n))


class DSAAttention(nn.Module):
    """``self_attn`` of one decoder layer (MLA weights; ``indexer`` on full layers)."""

    def __init__(
        self,
        cfg: DSAConfig,
        layer: int,
        rows: "CacheLayer",
        index_cache: str,
        formats: tuple,
        max_pos: int,
    ) -> None:
        """``formats``: (row format, index key format or None for the row format's default)."""
        super().__init__()
        tp = _tp()
        if cfg.num_heads % tp[1]:
            raise ValueError(
                f"num_attention_heads ({cfg.num_heads}) is not divisible by "
                f"--tensor-parallel-size {tp[1]}: choose a size that divides it"
            )
        self.tp_size = tp[1]
        # The whole model's config but this rank's heads: MLA's math runs on those only.
        cfg = replace(cfg, num_heads=cfg.num_heads // tp[1])
        row_format, key_format = formats
        self.cfg, self.layer, self.row_format = cfg, layer, row_format
        device = get_current_vllm_config().device_config.device
        self.core = SparseMLACore(cfg, row_format, device, key_format=key_format)
        self.kv_rows = rows
        hq = cfg.num_heads * tp[1] * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        self.q_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)
        self.q_b_proj = _head_shard(cfg.q_lora_rank, hq, 0, tp)
        self.kv_a_proj_with_mqa = linear(cfg.hidden_size, cfg.kv_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=1e-6)
        kv_b = cfg.num_heads * tp[1] * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = _head_shard(cfg.kv_lora_rank, kv_b, 0, tp)
        self.o_proj = _head_shard(cfg.num_heads * tp[1] * cfg.v_head_dim, cfg.hidden_size, 1, tp)
        self.rotary_emb = get_rope(
            cfg.qk_rope_head_dim,
            max_position=max_pos,
            rope_parameters=vllm_rope_parameters(cfg),
            is_neox_style=False,
        )
        self.indexer = (
            DSAIndexer(cfg, index_cache, max_pos, self.core) if cfg.is_full(layer) else None
        )
        # The name the attention op finds this layer by (``attention_op``); ``step_of`` gives
        # a forward's Step (set by the model that owns the layer).
        self.op_name = f"model.layers.{layer}.self_attn"
        self.step_of = None
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if self.op_name in ctx:
            raise ValueError(f"duplicate layer name {self.op_name!r}")
        ctx[self.op_name] = self

    def attend_into(self, h, positions, out, selection) -> None:
        """The attention op's body: this layer's output into ``out`` [T, hidden] (rows past the
        step's tokens, vLLM's padding, zero) and, on a layer with an indexer, its top-k slots
        into ``selection`` (when the model keeps them for layers that share them); a layer
        without one reads them there."""
        step = self.step_of(positions)
        n = h.shape[0] if step is None else step.tokens.num_tokens
        shared = selection[:n] if self.indexer is None and step is not None else None
        o, sel = self.forward(h[:n], step, shared)
        out[:n].copy_(o)
        out[n:].zero_()
        if self.indexer is not None and step is not None and selection.shape[0]:
            selection[:n].copy_(sel)

    def forward(self, h: torch.Tensor, step: Optional[Step], selection):
        """(output [T, hidden], the top-k slots this layer used). ``step`` None: a dummy run."""
        cfg = self.cfg
        t = h.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(h))
        kv_a = self.kv_a_proj_with_mqa(h)
        c = cfg.kv_lora_rank
        latent = self.kv_a_layernorm(kv_a[:, :c].contiguous())
        if step is None:  # profiling: shapes only, no cache (the query heads' memory counted)
            self.q_b_proj(q_resid)
            return self._out(latent.new_zeros(t, cfg.num_heads * cfg.v_head_dim)), selection
        k_pe = self._rotated(step.positions, kv_a[:, None, c:].contiguous())
        rows = self.core.encode_rows(mla.latent_row(latent, k_pe.view(t, cfg.qk_rope_head_dim)))
        self._save(rows, step)
        if self.indexer is not None:
            selection = self.indexer.select(h, q_resid, step)
        values = self._attend(q_resid, selection, step)
        return self._out(values), selection

    def _save(self, rows: torch.Tensor, step: Step) -> None:
        """The step's new rows: to the host pool through the connector, or the resident rows."""
        if step.connector is not None:
            step.connector.save_kv_layer(self.kv_rows.prefix, rows, step.meta)
        else:
            self.kv_rows.rows().index_copy_(0, step.meta.slot_mapping, rows)

    def _heads(self, q_resid: torch.Tensor, step: Step):
        """(q_nope [T, H, nope], the rotated q_pe [T, H, rope]) of this rank's query heads."""
        cfg, t = self.cfg, q_resid.shape[0]
        q = self.q_b_proj(q_resid).view(t, cfg.num_heads, -1)
        q_pe = self._rotated(step.positions, q[..., cfg.qk_nope_head_dim :].contiguous())
        return q[..., : cfg.qk_nope_head_dim], q_pe.view(t, cfg.num_heads, cfg.qk_rope_head_dim)

    def _rotated(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, n, rope] rotated at ``positions``. The key and the query heads are rotated apart
        (the heads wait for the resolve), but DeepSeek's YaRN rotary wants a key beside every
        query: a one-head view of x goes along (each value's math is its own)."""
        return self.rotary_emb.forward_native(positions, x, x[:, :1])[0]

    def _out(self, values: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of this rank's heads' values, summed over the ranks' heads."""
        out = self.o_proj(values)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    def _attend(self, q_resid, selection: torch.Tensor, step: Step) -> torch.Tensor:
        """Per-head values [T, H * v_head_dim]: decodes (the leading rows) over the hot buffer
        or the resident rows, then the prefill tokens in chunks over rows read by slot. The
        query heads (``_heads`` of ``q_resid``) are made after the decodes' resolve."""
        meta, connector = step.meta, step.connector
        name, kv_b = self.kv_rows.prefix, self.kv_b_proj.weight
        store = self.kv_rows.rows() if connector is None else None
        nd, q = meta.num_decodes, meta.decode_len
        td = meta.query_start[nd]  # the decodes' tokens lead
        keys = selection[:td]
        if nd and connector is not None:
            # One row per request: the union of its tokens' top-k (``union``).
            at = step.decode_at
            top_k = union_rows(keys, at, nd, q) if self.indexer is not None else None
            defer = self.core.reads_misses(td)  # the row read fetches them (kernels/misses)
            rows = step.state_rows
            got = connector.resolve(name, top_k, state_rows=rows, defer_misses=defer)
            ids = token_ids(got, at, q)
        # The query heads need no row: made while the resolve's misses copy in (copy stream).
        q_nope, q_pe = self._heads(q_resid, step)
        parts = []
        if nd:
            query = self.core.query(q_nope[:td], q_pe[:td], kv_b)
            if connector is not None:
                connector.wait_for_layer_load(name)
                src, misses = connector.hot_rows(name), connector.miss_plan(name)
            else:
                src, ids, misses = store, keys, None
            parts.append(self.core.attend_query(query, kv_b, src, ids, misses))
        t, k = selection.shape
        n = max(1, CHUNK_ELEMS // (k * self.cfg.kv_dim))
        for s in range(td, t, n):
            keys = selection[s : s + n]
            if connector is not None:  # this chunk's rows, gathered from the host pool
                src = connector.load_host_rows(name, keys)
                ids = torch.arange(keys.numel(), device=keys.device).view(keys.shape)
                ids = torch.where(keys >= 0, ids, keys)
            else:
                src, ids = store, keys
            parts.append(self.core.attend(q_nope[s : s + n], q_pe[s : s + n], kv_b, src, ids))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
