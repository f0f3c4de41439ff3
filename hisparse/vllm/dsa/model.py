"""``HiSparseDeepseekV32ForCausalLM`` / ``HiSparseGlmMoeDsaForCausalLM``: DeepSeek-V3.2 and
GLM-5 checkpoints (as transformers writes them) served by vLLM on its CPU build.

vLLM's own layers do everything but attention: embeddings, RMSNorm, the dense MLP and the MoE
(``DeepseekV2MLP`` / ``DeepseekV2MoE``: grouped sigmoid routing with the correction bias, shared
experts), the LM head. Attention (``hisparse.vllm.dsa.attention``) is ours, since vLLM's sparse
MLA refuses the CPU: it runs all-resident on vLLM's KV cache, or through the HiSparse connector
when ``--kv-transfer-config`` names it (``kv_connector_module_path="hisparse.vllm.connector"``).
Index groups: a full indexer layer leads the shared layers after it (GLM-5); the connector
resolves once per group.

vLLM compiles ``DSAModel`` unless ``--enforce-eager``: each layer's attention is one opaque op
(``attention_op``) that reads the step's metadata itself, so the traced graph holds no per-step
host decision; the MTP draft calls the layers' eager form.
"""

from __future__ import annotations

from typing import Iterable, Optional, Set, Tuple

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP, DeepseekV2MoE

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import TokenBatch, token_rows
from hisparse.models.dsa.union import decode_token_rows
from hisparse.vllm.cache_layers import SparseMLACache
from hisparse.vllm.dsa import (
    attention_op,  # noqa: F401  (registers hisparse::dsa_attention)
    served_config,
)
from hisparse.vllm.dsa.attention import DSAAttention, Step
from hisparse.vllm.dsa.weights import load_dsa_weights
from hisparse.vllm.model_connector import active_connector, uses_hisparse_connector

KEY_FORMAT_KEY = "hisparse_key_format"


def _routing_config(hf) -> None:
    """transformers routes DSA models by sigmoid + correction bias; vLLM's MoE reads that from
    ``scoring_func`` / ``topk_method``, which transformers' configs do not write."""
    for name, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if getattr(hf, name, None) is None:
            setattr(hf, name, value)


def forward_step(
    index_name: str, positions: torch.Tensor, hisparse: bool, kept: Optional[dict] = None
) -> Optional[Step]:
    """This forward's ``Step`` from the metadata vLLM built for the index cache ``index_name``
    (None in a profiling / dummy run, which has no KV cache): the tokens as the core reads
    them and, with the connector, the decode rows' state rows and each decode token's slice of
    its row (``union``). ``kept``: the MTP draft's, when it drafts several tokens: its first
    pass finds every row's state row there, its later passes (one token per row, past the
    scheduled positions, so with no anchor) reuse them."""
    attn = get_forward_context().attn_metadata
    meta = attn.get(index_name) if isinstance(attn, dict) else None
    if meta is None:
        return None
    n = meta.num_tokens
    tokens = TokenBatch(
        positions=positions[:n].long(),
        req=token_rows(meta.query_start_loc, n),
        seq_lens=meta.seq_lens_dev,
        block_table=meta.block_table,
        block_size=meta.block_size,
    )
    step = Step(meta, tokens)
    if hisparse:
        step.connector = active_connector()
        nd, q = meta.num_decodes, meta.decode_len
        if kept is not None and meta.draft_index == 0:
            kept["rows"] = _state_rows(step, meta.num_reqs)
        elif meta.draft_index:  # the draft's group resolves again within the step
            step.connector.next_pass()
        if nd:
            rows = kept["rows"][:nd] if kept is not None else _state_rows(step, nd)
            step.state_rows = rows
            req = tokens.req[: meta.query_start[nd]]
            step.decode_at = decode_token_rows(req, meta.query_start_loc, q)
    return step


def _state_rows(step: Step, rows: int) -> torch.Tensor:
    """The state rows of the batch's first ``rows`` rows, found by the key of each one's last
    token this step (the scheduler's anchors), on the device."""
    meta = step.meta
    if meta.decode_len == 1 and rows <= meta.num_decodes:  # one token per row
        slots = meta.slot_mapping[:rows]
    else:
        slots = meta.slot_mapping[meta.query_start_loc[1 : rows + 1].long() - 1]
    return step.connector.batch_state_rows(slots)


def decoder_mlp(vllm_config: VllmConfig, layer: int, prefix: str) -> nn.Module:
    """Layer ``layer``'s dense MLP or MoE, vLLM's own, with vLLM's quant_config: on the block-FP8
    path (``fp8_plan``) an ``Fp8Config`` that keeps the weights in FP8, else None."""
    hf = vllm_config.model_config.hf_config
    # transformers' per-layer list wins; older configs only give first_k_dense_replace.
    kinds = getattr(hf, "mlp_layer_types", None)
    first_dense = getattr(hf, "first_k_dense_replace", 0)
    quant = vllm_config.quant_config
    if kinds[layer] == "dense" if kinds is not None else layer < first_dense:
        return DeepseekV2MLP(
            hf.hidden_size, hf.intermediate_size, hf.hidden_act, quant_config=quant, prefix=prefix
        )
    return DeepseekV2MoE(
        hf,
        vllm_config.parallel_config,
        quant_config=quant,
        prefix=prefix,
        apply_routed_scale_to_output=True,
    )


class DSADecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, cfg: DSAConfig, layer: int, names) -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        prefix = f"model.layers.{layer}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=hf.rms_norm_eps)
        self.self_attn = DSAAttention(
            cfg,
            layer,
            names.rows[layer],
            names.index[layer],
            (names.fmt, names.key_fmt),
            hf.max_position_embeddings,
        )
        self.mlp = decoder_mlp(vllm_config, layer, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, step: Optional[Step], selection):
        """The eager form (the MTP draft's): attention called directly with the step."""
        o, selection = self.self_attn(self.input_layernorm(x), step, selection)
        x = x + o
        return x + self.mlp(self.post_attention_layernorm(x)), selection

    def forward_op(self, x: torch.Tensor, positions: torch.Tensor, selection: torch.Tensor):
        """The compilable form: attention through the opaque op, which reads the step itself."""
        h = self.input_layernorm(x)
        o = torch.empty_like(h)
        torch.ops.hisparse.dsa_attention(h, positions, o, selection, self.self_attn.op_name)
        x = x + o
        return x + self.mlp(self.post_attention_layernorm(x))


class _Names:
    """Row-cache layers (one per decoder layer) and index-cache names (full layers)."""

    def __init__(self, cfg: DSAConfig, fmt: str, key_fmt: Optional[str], hisparse: bool) -> None:
        self.fmt, self.key_fmt = fmt, key_fmt
        attn = [f"model.layers.{i}.self_attn.attn" for i in range(cfg.num_layers)]
        self.index = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(cfg.num_layers)]
        # With the connector vLLM allocates no row storage: the host pool and hot buffers do.
        self.rows = [
            SparseMLACache(n, cfg.row_bytes(fmt), attn[cfg.leader(i)], not hisparse)
            for i, n in enumerate(attn)
        ]
        self.first_index = self.index[0]


_NO_STEP = object()


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class DSAModel(nn.Module):
    """Embeddings, the decoder layers and the final norm: what vLLM compiles (unless
    ``--enforce-eager``), each layer's attention an opaque op (``attention_op``) it traces
    around. ``selection`` keeps a full indexer layer's top-k slots for the layers that share
    them (GLM-5's index groups); a model without shared layers keeps none."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", cfg=None, names=None):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.names, self.hisparse = names, uses_hisparse_connector(vllm_config)
        self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DSADecoderLayer(vllm_config, cfg, i, names) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=hf.rms_norm_eps)
        shared = any(not cfg.is_full(i) for i in range(cfg.num_layers))
        rows = vllm_config.scheduler_config.max_num_batched_tokens if shared else 0
        self.register_buffer(
            "selection", torch.full((rows, cfg.index_topk), -1, dtype=torch.int64), False
        )
        for layer in self.layers:
            layer.self_attn.step_of = self.step_of

    def step_of(self, positions: torch.Tensor) -> Optional[Step]:
        """This forward's Step, built by the first layer that asks (kept on vLLM's forward
        context, which is new every forward)."""
        ctx = get_forward_context()
        step = getattr(ctx, "_hisparse_dsa_step", _NO_STEP)
        if step is _NO_STEP:
            step = forward_step(self.names.first_index, positions, self.hisparse)
            ctx._hisparse_dsa_step = step
        return step

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        selection = self.selection[: x.shape[0]] if self.selection.shape[0] else self.selection
        for layer in self.layers:
            x = layer.forward_op(x, positions, selection)
        return self.norm(x)


class _DSAForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        cfg = DSAConfig.from_hf(hf)
        cfg.check_context(vllm_config.model_config.max_model_len, "--max-model-len")
        _routing_config(hf)
        self.cfg = cfg
        self.hisparse = uses_hisparse_connector(vllm_config)
        # The index keys' format: --hf-overrides '{"hisparse_key_format": "fp8" | "f32"}'
        # (default: fp8 beside fp8 rows, else f32).
        key_fmt = getattr(hf, KEY_FORMAT_KEY, None)
        fmt = served_config.row_format(vllm_config, cfg)
        self.names = _Names(cfg, fmt, key_fmt, self.hisparse)
        self.model = DSAModel(vllm_config=vllm_config, prefix="model", cfg=cfg, names=self.names)
        self.lm_head = ParallelLMHead(hf.vocab_size, cfg.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(hf.vocab_size)
        self.n_routed_experts = hf.n_routed_experts

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        return load_dsa_weights(self, weights, self.cfg, self.n_routed_experts)


class HiSparseDeepseekV32ForCausalLM(_DSAForCausalLM):
    """A ``DeepseekV32ForCausalLM`` checkpoint with HiSparse-capable sparse attention."""


class HiSparseGlmMoeDsaForCausalLM(_DSAForCausalLM):
    """A ``GlmMoeDsaForCausalLM`` checkpoint with HiSparse-capable sparse attention."""
