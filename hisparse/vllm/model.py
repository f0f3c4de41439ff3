"""``HiSparseMLAForCausalLM``: the reference sparse-MLA model (``hisparse.engine``) as a vLLM
architecture, served from a directory written by ``hisparse export-model``.

Per layer: project the new tokens, store their latent rows, let the group's indexer pick each
query token's top-k positions (leader layers), then attend over those rows only. Where the rows
come from is the one thing the two modes change:

* all-resident (no connector): from the layer's own vLLM KV cache, by slot;
* HiSparse (``kv_connector_module_path="hisparse.vllm.connector"``): rows are saved to the host pool
  through the connector; decode rows are resolved by the group leader (``connector.resolve``),
  every member gathers the same plan into its own hot buffer, waits for its own load and reads
  there; prefill rows are read from the host pool.

Both modes then run the same attention call on the same row bytes, so tokens are identical.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Set, Tuple

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context

from hisparse.models.checkpoint import config_from_hf, weights_by_name
from hisparse.models.reference import Model, select_top_k
from hisparse.models.rows import LATENT_DIM, decode_rows, encode_rows
from hisparse.vllm.cache_layers import CacheLayer, SparseMLACache
from hisparse.vllm.model_connector import active_connector, uses_hisparse_connector
from hisparse.vllm.step_metadata import StepMetadata

# Bound on one prefill attention gather ([tokens, top_k, 576] values).
_PREFILL_CHUNK_ELEMS = 1 << 24


class IndexerCache(CacheLayer):
    """An index group's indexer key and query per token (float32, [key | query]); its block
    table is the one every layer uses, and in HiSparse mode its ``slot_mapping`` values are the
    tokens' keys (host row ids)."""

    def __init__(self, prefix: str, indexer_dim: int) -> None:
        super().__init__(prefix, 2 * indexer_dim, torch.float32, True)


class _Batch:
    """Per-forward host-side view of the batch: which tokens are decode rows, context keys."""

    def __init__(self, meta: StepMetadata) -> None:
        self.meta = meta
        bs = meta.block_size
        bt = meta.block_table.long()
        self.decode: List[int] = []
        self.prefill: List[int] = []
        self.context_keys: List[torch.Tensor] = []
        self.query_pos: List[torch.Tensor] = []
        for r in range(meta.num_reqs):
            a, b = meta.query_start[r], meta.query_start[r + 1]
            seq = meta.seq_lens[r]
            pos = torch.arange(seq, device=bt.device)
            self.context_keys.append(bt[r, pos // bs] * bs + pos % bs)
            self.query_pos.append(pos[seq - (b - a) :])
            (self.decode if b - a == 1 else self.prefill).append(r)
        self.decode_tokens = torch.tensor(
            [meta.query_start[r] for r in self.decode], dtype=torch.long, device=bt.device
        )

    def tokens(self, r: int) -> slice:
        return slice(self.meta.query_start[r], self.meta.query_start[r + 1])


class HiSparseMLAForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = config_from_hf(vllm_config.model_config.hf_config)
        self.cfg = cfg
        self.hisparse = uses_hisparse_connector(vllm_config)
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.m = Model(cfg, device)
        rb = cfg.row_bytes
        pre = f"{prefix}." if prefix else ""
        self.layer_names = [f"{pre}layers.{i}.attn" for i in range(cfg.num_layers)]
        leaders = [
            self.layer_names[cfg.group_of(i) * cfg.index_share] for i in range(cfg.num_layers)
        ]
        # In HiSparse mode vLLM allocates no row storage: the connector owns it.
        self.kv_layers = nn.ModuleList(
            SparseMLACache(n, rb, leaders[i], declare=not self.hisparse)
            for i, n in enumerate(self.layer_names)
        )
        self.index_names = [f"{pre}indexers.{g}.cache" for g in range(cfg.num_groups)]
        self.index_layers = nn.ModuleList(
            IndexerCache(n, cfg.indexer_dim) for n in self.index_names
        )

    # ---- vLLM model interface ---------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.m.embed(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.m.logits(hidden_states)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        targets = weights_by_name(self.m)
        loaded: Set[str] = set()
        for name, w in weights:
            if name not in targets:
                raise ValueError(
                    f"model.safetensors holds {name!r}, which the "
                    "HiSparse reference model does not have"
                )
            t = targets[name]
            if tuple(w.shape) != tuple(t.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(t.shape)}"
                )
            t.copy_(w.to(dtype=t.dtype))
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(
                f"model.safetensors lacks {missing[0]} ({len(missing)} missing): "
                "re-run `hisparse export-model`"
            )
        return loaded

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        m, cfg = self.m, self.cfg
        x = m.embed(input_ids) if inputs_embeds is None else inputs_embeds
        attn = get_forward_context().attn_metadata
        meta = attn.get(self.index_names[0]) if isinstance(attn, dict) else None
        if meta is None:  # profiling / dummy run: no KV cache, shapes only
            o = x.new_zeros(x.shape[0], LATENT_DIM)
            for layer in range(cfg.num_layers):
                x = m.finish_layer(x, o, layer)
            return x
        batch = _Batch(meta)
        T = meta.num_tokens
        pos = positions[:T].long()
        x = x[:T]
        connector = active_connector() if self.hisparse else None
        state_rows = None
        if connector is not None and batch.decode:
            state_rows = connector.batch_state_rows(meta.slot_mapping[batch.decode_tokens])
        selection: List[torch.Tensor] = []
        for layer in range(cfg.num_layers):
            h, kv, q = m.project(x, layer, pos)
            if cfg.is_leader(layer):
                selection = self._select(cfg.group_of(layer), h, pos, batch)
            rows = encode_rows(kv, cfg.row_format)
            o = self._attend(layer, q, rows, selection, batch, connector, state_rows)
            x = m.finish_layer(x, o, layer)
        return x

    # ---- pieces -----------------------------------------------------------------------------
    def _select(self, g: int, h: torch.Tensor, pos: torch.Tensor, batch: _Batch) -> list:
        """Store the indexer's key/query of the new tokens; return, per request, the keys of the
        top-k positions of each of its query tokens (int64 [q_len, top_k], -1 padding)."""
        m, cfg = self.m, self.cfg
        meta = batch.meta
        di = cfg.indexer_dim
        cache = self.index_layers[g].rows()
        cache[meta.slot_mapping] = torch.cat([m.index_key(h, g, pos), m.index_query(h, g)], -1)
        out = []
        for r in range(meta.num_reqs):
            keys = batch.context_keys[r]
            qpos = batch.query_pos[r]
            kq = cache[keys]
            w = _ema_weights(qpos, keys.numel(), cfg.drift).to(kq.dtype)
            scores = (w @ kq[:, di:]) @ kq[:, :di].T
            sel = select_top_k(scores, qpos + 1, cfg.top_k, cfg.recent_window)
            out.append(torch.where(sel >= 0, keys[sel.clamp(min=0)], sel))
        return out

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        rows: torch.Tensor,
        selection: list,
        batch: _Batch,
        connector,
        state_rows,
    ) -> torch.Tensor:
        cfg = self.cfg
        meta = batch.meta
        name = self.layer_names[layer]
        if connector is not None:
            connector.save_kv_layer(name, rows, meta)
            store = connector.host_rows(name) if batch.prefill else None
        else:
            store = self.kv_layers[layer].rows()
            store[meta.slot_mapping] = rows
        out = q.new_zeros(q.shape[0], LATENT_DIM)
        if batch.decode:
            keys = torch.cat([selection[r] for r in batch.decode])
            if connector is not None:
                top_k = keys.to(torch.int32) if cfg.is_leader(layer) else None
                where = connector.resolve(name, top_k, state_rows=state_rows)
                connector.wait_for_layer_load(name)
                got = connector.hot_rows(name)[where.long().clamp(min=0)]
            else:
                got = store[keys.clamp(min=0)]
            out[batch.decode_tokens] = self._attend_rows(q[batch.decode_tokens], got, keys)
        for r in batch.prefill:
            keys = selection[r]
            tok = batch.tokens(r)
            step = max(1, _PREFILL_CHUNK_ELEMS // (keys.shape[1] * 576))
            for s in range(0, keys.shape[0], step):
                k = keys[s : s + step]
                out[tok][s : s + step] = self._attend_rows(
                    q[tok][s : s + step], store[k.clamp(min=0)], k
                )
        return out

    def _attend_rows(self, q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor):
        valid = keys >= 0
        # Padding entries read an arbitrary row; zero it so no NaN byte pattern reaches softmax.
        rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))
        return self.m.attend(q, decode_rows(rows, self.cfg.row_format, self.m.dtype), valid)


def _ema_weights(qpos: torch.Tensor, n: int, drift: float) -> torch.Tensor:
    """[len(qpos), n] weights of the indexer query EMA q_i = (1-a) q_{i-1} + a u_i (q_{-1} = u_0)
    over u_0..u_{n-1}, for query positions ``qpos``; in float64 (cast by the caller)."""
    a = float(drift)
    i = qpos.to(torch.float64).unsqueeze(1)
    j = torch.arange(n, dtype=torch.float64, device=qpos.device).unsqueeze(0)
    w = torch.where(
        j <= i, a * (1.0 - a) ** (i - j), torch.zeros((), dtype=torch.float64, device=qpos.device)
    )
    w[:, 0] = (1.0 - a) ** i.squeeze(1)
    return w
