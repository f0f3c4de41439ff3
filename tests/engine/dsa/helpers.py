"""Shared pieces of the DSA engine tests: tiny checkpoints, one-thread runs, near-tie-aware token
comparison."""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch

from hisparse.engine.dsa.generate import byte_prompts, generate
from hisparse.models.dsa.weights import load_checkpoint

ARCHS = ("deepseek_v32", "glm_moe_dsa")
#: Below this top-1 / top-2 logit gap a greedy step is a near tie: float32 rounding (another
#: summation order, another device) may pick the other token, so comparisons stop there.
NEAR_TIE = 0.05
#: First-step logits of the engine vs transformers, both float32 (see test_transformers.py).
LOGIT_TOL = 1e-3
PROMPTS, NEW = 8, 16
#: Latent sizes other than the released models' 512 + 64, as checkpoints made for tests often
#: have. Rows pad to 16 B: GLM-5's f32 rows (42 + 8 values, 200 B) to 208, its bf16 ones to 112,
#: DeepSeek-V3.2's fp8 rows (256 + 32: 256 B, 8 B of scales, 64 B of rope) to 336.
OTHER_SIZES = {
    "deepseek_v32": dict(kv_lora_rank=256, qk_rope_head_dim=32, index_head_dim=48),
    "glm_moe_dsa": dict(kv_lora_rank=42, qk_rope_head_dim=8, index_head_dim=24),
}


@contextlib.contextmanager
def one_thread():
    """The engine's ops are tiny: one torch thread is many times faster on a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def first_near_tie(gaps: Sequence[float]) -> int:
    """Index of the first step whose logit gap is below ``NEAR_TIE`` (len(gaps) if none)."""
    return next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))


def tie_aware_mismatch(
    want: List[int], got: List[int], gaps: Sequence[float], other_gaps: Optional[Sequence] = None
) -> Optional[str]:
    """None when ``got`` equals ``want`` up to the first near-tie step (of either run), else a
    message naming the step."""
    stop = first_near_tie(gaps)
    if other_gaps is not None:
        stop = min(stop, first_near_tie(other_gaps))
    for i in range(min(stop + 1, len(want), len(got))):
        if want[i] != got[i]:
            return f"step {i}: want token {want[i]}, got {got[i]} (gap {gaps[i]:.4f})"
    return None


def reference_tokens(model_dir, prompts, new: int):
    """transformers' greedy tokens (no stop token, like the engine) and first-step logits."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    m.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = m.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(p) :].tolist())
            logits.append(m(ids).logits[0, -1].float())
    return tokens, logits


def compare_with_transformers(model_dir, device: torch.device, mode: str = "resident"):
    """(report line, failures) of the engine (f32 rows, ``mode``) on ``device`` against
    transformers on the CPU."""
    ck = load_checkpoint(model_dir, device)
    prompts = byte_prompts(ck, PROMPTS)
    with one_thread():
        want, want_logits = reference_tokens(model_dir, prompts, NEW)
        got = generate(ck, mode, "f32", device, prompts, NEW)
    failures, exact, worst = [], 0, 0.0
    for i in range(len(prompts)):
        exact += want[i] == got.tokens[i]
        diff = float((want_logits[i] - got.first_logits[i]).abs().max())
        worst = max(worst, diff)
        bad = tie_aware_mismatch(want[i], got.tokens[i], got.gaps[i])
        if bad or diff > LOGIT_TOL:
            failures.append(f"prompt {i}: {bad or 'tokens ok'}, first-step logit diff {diff:.2e}")
    line = (
        f"{ck.cfg.arch} {mode} on {device}: {exact}/{len(prompts)} prompts token-identical to "
        f"transformers, max first-step logit diff {worst:.1e}"
    )
    return line, failures


def dense_checkpoint(tmp_path, device):
    """A GLM-5 checkpoint of dense layers only, loaded on ``device``: the sync checks use it, since
    the engine's reference MoE reads its experts' ids on the host (the vLLM classes use vLLM's
    fused MoE)."""
    from hisparse.models.dsa.random_checkpoint import write_random_checkpoint

    d = write_random_checkpoint(
        tmp_path / "dense", "glm_moe_dsa", seed=1, first_k_dense_replace=4,
        mlp_layer_types=["dense"] * 4,
    )  # fmt: skip
    return load_checkpoint(d, device)


def strict_hook(calls: list):
    """A ``step_hook`` that runs each forward under ``set_sync_debug_mode("error")`` (a host
    sync in the step raises) and counts it in ``calls``."""

    def strict(fn):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(1)
        return out

    return strict
