"""``HiSparseDeepseekV32MTP``: the multi-token-prediction layer of a DeepSeek-V3.2 / GLM-5
checkpoint as vLLM's ``method="mtp"`` draft, with the same sparse attention as the target
(``DSADecoderLayer`` / ``DSAAttention``: all-resident, or through the HiSparse connector as the
index-group leader of its own group).

vLLM 0.32 drafts these model types with ``DeepseekV32MTPModel``, whose sparse MLA the CPU
platform refuses; ``hisparse.vllm.dsa.mtp_config`` says how a draft config gets this class
instead (the plugin's patch on the CPU, or the callable ``hf_overrides``).

Weights as the checkpoint stores them, ``model.layers.{num_hidden_layers}.*``: ``enorm``,
``hnorm``, ``eh_proj``, the decoder layer, ``shared_head.{norm,head}``; its ``embed_tokens`` is
the target's (vLLM shares the target's embedding with an MTP draft).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional, Set, Tuple

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

from hisparse.models.dsa.config import DSAConfig
from hisparse.vllm.cache_layers import SparseMLACache
from hisparse.vllm.dsa import served_config
from hisparse.vllm.dsa.model import (
    KEY_FORMAT_KEY,
    DSADecoderLayer,
    _routing_config,
    forward_step,
)
from hisparse.vllm.dsa.mtp_config import hf_overrides  # noqa: F401 (the API's callable)
from hisparse.vllm.dsa.weights import load_dsa_weights
from hisparse.vllm.model_connector import uses_hisparse_connector


class _Names:
    """Row cache and index-cache names of the MTP layer only (the target registers the rest)."""

    def __init__(self, cfg: DSAConfig, layer: int, fmt: str, key_fmt, hisparse: bool) -> None:
        self.fmt, self.key_fmt = fmt, key_fmt
        attn = f"model.layers.{layer}.self_attn.attn"
        self.index = {layer: f"model.layers.{layer}.self_attn.indexer.k_cache"}
        # Its own index group: the draft runs in a forward of its own, without the target's
        # top-k of the same positions.
        self.rows = {layer: SparseMLACache(attn, cfg.row_bytes(fmt), attn, not hisparse)}
        self.first_index = self.index[layer]


class _SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps=eps)
        self.head = ParallelLMHead(vocab, hidden, prefix="shared_head.head")


class _MTPLayer(DSADecoderLayer):
    def __init__(self, vllm_config: VllmConfig, cfg: DSAConfig, layer: int, names) -> None:
        super().__init__(vllm_config, cfg, layer, names)
        hf = vllm_config.model_config.hf_config
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, eps=hf.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=hf.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = _SharedHead(h, hf.vocab_size, hf.rms_norm_eps)


class HiSparseDeepseekV32MTP(nn.Module):
    """The first MTP layer of a DeepSeek-V3.2 / GLM-5 checkpoint (one speculative token)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config  # the draft's own copy of config.json
        _routing_config(hf)
        base = DSAConfig.from_hf(hf)
        n = base.num_layers
        kinds = getattr(hf, "mlp_layer_types", None)
        if kinds is not None and len(kinds) == n:
            hf.mlp_layer_types = list(kinds) + ["sparse"]  # DeepSeek / GLM MTP layers are MoE
        self.cfg = replace(base, num_layers=n + 1, indexer_types=base.indexer_types + ("full",))
        self.index = n
        self.hisparse = uses_hisparse_connector(vllm_config)
        key_fmt = getattr(hf, KEY_FORMAT_KEY, None)
        fmt = served_config.row_format(vllm_config, base)
        self.names = _Names(self.cfg, n, fmt, key_fmt, self.hisparse)
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(hf.vocab_size, base.hidden_size)
        self.model.layers = nn.ModuleDict({str(n): _MTPLayer(vllm_config, self.cfg, n, self.names)})
        self.logits_processor = LogitsProcessor(hf.vocab_size)
        self.n_routed_experts = hf.n_routed_experts
        # Drafting several tokens: the later passes' rows have no anchor (``forward_step``).
        spec = vllm_config.speculative_config
        several = (getattr(spec, "num_speculative_tokens", None) or 1) > 1
        self._kept = {} if several and self.hisparse else None

    @property
    def layer(self) -> _MTPLayer:
        return self.model.layers[str(self.index)]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        spec_step_idx: int = 0,
        **kwargs,
    ) -> torch.Tensor:
        e = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        step = forward_step(self.names.first_index, positions, self.hisparse, self._kept)
        if step is not None:  # None: profiling / dummy run
            n = step.tokens.num_tokens
            e, positions, hidden_states = e[:n], positions[:n], hidden_states[:n]
        # As vLLM's DeepSeekMultiTokenPredictorLayer: position 0 has no previous token.
        e = torch.where(positions.unsqueeze(-1) == 0, torch.zeros_like(e), e)
        m = self.layer
        x = m.eh_proj(torch.cat([m.enorm(e), m.hnorm(hidden_states)], dim=-1))
        x, _ = m(x, step, None)
        return x

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0):
        head = self.layer.shared_head
        return self.logits_processor(head.head, head.norm(hidden_states))

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        p = f"model.layers.{self.index}."
        # The target's tensors are the target's; the MTP layer's embedding is the target's too.
        mine = (
            (name, w)
            for name, w in weights
            if name.startswith(p) and not name.startswith(p + "embed_tokens.")
        )
        loaded = load_dsa_weights(self, mine, self.cfg, self.n_routed_experts)
        return loaded | {"model.embed_tokens.weight"}
