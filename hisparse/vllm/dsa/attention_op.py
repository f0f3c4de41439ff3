"""The DSA layer's attention (projections, the indexer's top-k, the connector's save and
resolve, MLA, o_proj) as one opaque torch op, ``hisparse::dsa_attention``, the way vLLM wraps its
own attention: a compiled model traces around it and vLLM's piecewise compilation splits its
graphs there (the plugin adds it to vLLM's splitting ops), so the rest of the model (norms, MLP,
MoE) can be compiled and captured while this part, which reads vLLM's per-step metadata on the
host and calls the connector, runs eagerly each step.

The op finds its layer by name in vLLM's forward context and writes the layer's output (and, on
a layer with its own indexer, its top-k slots for the layers that share them) in place.
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context

OP_NAME = "hisparse::dsa_attention"


@torch.library.custom_op(OP_NAME, mutates_args=("out", "selection"))
def dsa_attention(
    h: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    selection: torch.Tensor,
    layer_name: str,
) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    layer.attend_into(h, positions, out, selection)


@dsa_attention.register_fake
def _(h, positions, out, selection, layer_name) -> None:
    return None
