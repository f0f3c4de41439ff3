"""Tiny seeded DeepSeek-V3.2 / GLM-5 checkpoints, made by transformers' own config and model
classes (``save_pretrained``): the config.json fields and tensor names of the real ones, at real
latent sizes (kv_lora_rank 512, qk_rope_head_dim 64) but a few layers and experts, plus the
byte-level tokenizer of ``hisparse.models.checkpoint_files`` so vLLM serves the directory offline.

transformers is imported only when a checkpoint is made (it is not a hisparse dependency).

    make_checkpoint(out_dir, "deepseek_v32")   # or "glm_moe_dsa"
    fp8_dir, ref_dir = make_fp8_checkpoint(out_dir, "glm_moe_dsa")  # block-FP8, as released

Weights are transformers' seeded init, then: non-trivial norms and routing biases (so loading
them is exercised) and an LM head scaled by ``HEAD_GAIN`` (wider logit gaps: greedy tokens are
well separated instead of near ties, and the text varies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Tuple, Union

import torch

from hisparse.models.checkpoint_files import NUM_BYTE_TOKENS, tokenizer_files

ARCHS = ("deepseek_v32", "glm_moe_dsa")
MAX_LEN = 512
INDEX_TOPK = 16
HEAD_GAIN = 4.0
INIT_STD = 0.1

_COMMON = dict(
    vocab_size=NUM_BYTE_TOKENS + 1,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=512,
    q_lora_rank=96,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    first_k_dense_replace=1,
    index_topk=INDEX_TOPK,
    index_head_dim=128,
    index_n_heads=16,
    max_position_embeddings=MAX_LEN,
    initializer_range=INIT_STD,
    bos_token_id=None,
    eos_token_id=NUM_BYTE_TOKENS,
    pad_token_id=None,
    tie_word_embeddings=False,
)
_ARCH = {
    # Released DeepSeek-V3.2: grouped routing, YaRN rope with mscale folded into the scale.
    "deepseek_v32": dict(
        n_group=2,
        topk_group=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # GLM-5: one routing group, plain rope, full / shared indexer layers (index groups of 2).
    "glm_moe_dsa": dict(
        n_group=1,
        topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        indexer_types=["full", "shared", "full", "shared"],
        rms_norm_eps=1e-5,
    ),
}


def _model(arch: str, sizes: dict):
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    import transformers

    if arch == "deepseek_v32":
        conf, cls = transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM
    else:
        conf, cls = transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM
    return cls(conf(**{**_COMMON, **_ARCH[arch], **sizes}))


@torch.no_grad()
def _perturb(model, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    model.lm_head.weight.mul_(HEAD_GAIN)


def make_checkpoint(out_dir: Union[str, Path], arch: str, seed: int = 0, **sizes) -> Path:
    """Write a seeded tiny ``arch`` checkpoint with its tokenizer into ``out_dir``; ``sizes``:
    config fields in place of the defaults above (``kv_lora_rank=64``...)."""
    torch.manual_seed(seed)
    model = _model(arch, sizes).float().eval()
    _perturb(model, torch.Generator().manual_seed(seed + 1))
    out = Path(out_dir)
    model.save_pretrained(out)
    files = {"generation_config.json": {"eos_token_id": NUM_BYTE_TOKENS}}
    files.update(tokenizer_files(MAX_LEN))
    for name, payload in files.items():
        (out / name).write_text(json.dumps(payload, indent=1) + "\n")
    return out


def make_fp8_checkpoint(
    out_dir: Union[str, Path],
    arch: str,
    seed: int = 0,
    block: Sequence[int] = (128, 128),
    shards: int = 1,
) -> Tuple[Path, Path]:
    """(``out_dir/fp8``, ``out_dir/dequantized``): the seeded tiny ``arch`` checkpoint in
    DeepSeek's block-FP8 format (``hisparse.models.dsa.fp8_weights``), and the same checkpoint
    with those weights dequantized to float32 - what transformers runs as the reference. 128 x 128
    blocks (the released size) leave partial edge blocks at these sizes (96, 576, 64 wide), so
    the edge handling is exercised; ``shards`` > 1 splits the weights over files with an index."""
    import shutil

    from hisparse.models.dsa.fp8_weights import quantize_checkpoint

    out = Path(out_dir)
    src = make_checkpoint(out / "source", arch, seed)
    fp8_dir, ref_dir = out / "fp8", out / "dequantized"
    quantize_checkpoint(src, fp8_dir, block, dequantized=ref_dir, shards=shards)
    shutil.rmtree(src)
    return fp8_dir, ref_dir
