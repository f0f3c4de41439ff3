"""A tiny DeepSeek-V3.2 / GLM-5 checkpoint with one multi-token-prediction layer
(``model.layers.{num_hidden_layers}.*``, as the released checkpoints store it), for the MTP
speculative-decoding tests of the engine (``hisparse.engine.dsa.mtp``) and of vLLM
(``hisparse.vllm.dsa.mtp``).

    write_mtp_checkpoint(out_dir, "deepseek_v32", agree=True)
    write_mtp_checkpoint(out_dir, "glm_moe_dsa", agree=True, fp8_block=(128, 128))  # block-FP8
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from hisparse.models.checkpoint_files import write_safetensors
from hisparse.models.dsa.random_checkpoint import random_weights, write_random_checkpoint

# The agreeing checkpoint's target layers add little to the embedding (o_proj / down_proj
# scaled by this), so its next token depends mostly on the current one, as the draft's does.
DAMP = 0.005


def write_mtp_checkpoint(
    out: Union[str, Path],
    arch: str,
    agree: bool,
    seed: int = 3,
    fp8_block: Optional[Sequence[int]] = None,
) -> Path:
    """A tiny checkpoint with one MTP layer ``model.layers.{num_hidden_layers}.*``. ``agree``:
    the MTP layer is the last target layer's copy, ``eh_proj`` passes the next token's embedding
    (at the embedding's scale) and the shared head is the target's norm and LM head, over a
    damped target; otherwise every MTP weight is random (drafts are mostly rejected).
    ``fp8_block``: the same checkpoint in DeepSeek's block-FP8 format with blocks of that size
    (``fp8_weights.quantize_checkpoint``: the target's and the MTP layer's attention, indexer
    and MLP / expert projections; ``eh_proj``, norms, embeddings and heads stay float32)."""
    out = Path(out)
    if fp8_block is not None:
        from hisparse.models.dsa.fp8_weights import quantize_checkpoint

        with tempfile.TemporaryDirectory(prefix="hisparse-mtp-") as tmp:
            src = write_mtp_checkpoint(Path(tmp) / "src", arch, agree, seed)
            return quantize_checkpoint(src, out, fp8_block)
    write_random_checkpoint(out, arch, seed=seed, num_nextn_predict_layers=1)
    hf = json.loads((out / "config.json").read_text())
    w = random_weights(hf, seed)
    n, hid = hf["num_hidden_layers"], hf["hidden_size"]
    if agree:
        for k in w:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                w[k] = DAMP * w[k]
    gen = torch.Generator().manual_seed(seed + 1)

    def fresh(t):
        return t.clone() if agree else 0.1 * torch.randn(t.shape, generator=gen)

    mtp, last = f"model.layers.{n}.", f"model.layers.{n - 1}."
    full = max(i for i in range(n) if f"model.layers.{i}.self_attn.indexer.wk.weight" in w)
    for k, v in list(w.items()):
        if k.startswith(last):
            w[mtp + k[len(last) :]] = fresh(v)
        elif k.startswith(f"model.layers.{full}.self_attn.indexer."):  # GLM-5: last is shared
            w[mtp + k[len(f"model.layers.{full}.") :]] = fresh(v)
    emb = w["model.embed_tokens.weight"]
    eh = torch.zeros(hid, 2 * hid)
    eh[:, :hid] = float(emb.pow(2).mean().sqrt()) * torch.eye(hid)
    w.update(
        {
            mtp + "enorm.weight": torch.ones(hid),
            mtp + "hnorm.weight": torch.ones(hid),
            mtp + "eh_proj.weight": eh if agree else fresh(eh),
            mtp + "shared_head.norm.weight": w["model.norm.weight"].clone(),
            mtp + "shared_head.head.weight": fresh(w["lm_head.weight"]),
            mtp + "embed_tokens.weight": emb.clone(),
        }
    )
    write_safetensors(out / "model.safetensors", w)
    return out
