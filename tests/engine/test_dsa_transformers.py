"""The DSA engine against transformers (skipped where transformers or its DeepSeek-V3.2 / GLM-5
classes are absent): on tiny checkpoints made by transformers itself
(``hisparse.models.dsa.make_checkpoint``), unquantized (f32) rows give transformers' greedy
tokens (eager attention, float32) for 8 prompts x 16 new tokens per architecture, compared up
to the first near-tie step, and first-step logits within ``LOGIT_TOL``.

Why the tolerance: both run float32 but sum differently (the engine attends over latent rows
with the absorbed query, transformers expands keys and values per head), so logits differ by
float32 rounding through 4 layers: about 3e-5 here for logits of magnitude ~10. 1e-3 is 30
times that and still 50 times below the near-tie gap (0.05) that decides the tokens.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.generate import byte_prompts, generate
from hisparse.models.dsa.weights import load_checkpoint
from tests.engine.dsa_helpers import ARCHS, one_thread, tie_aware_mismatch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GlmMoeDsaConfig") or not hasattr(transformers, "DeepseekV32Config"):
    pytest.skip("transformers lacks DeepseekV32 / GlmMoeDsa", allow_module_level=True)

LOGIT_TOL = 1e-3
PROMPTS, NEW = 8, 16
CPU = torch.device("cpu")


def reference_tokens(model_dir, prompts, new: int):
    """transformers' greedy tokens (no stop token, like the engine) and first-step logits."""
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


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from hisparse.models.dsa.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {a: make_checkpoint(root / a, a, seed=0) for a in ARCHS}


def compare_with_transformers(model_dir, device: torch.device, row_format: str = "f32"):
    """(report lines, failures) of the engine on ``device`` against transformers on the CPU."""
    ck = load_checkpoint(model_dir, device)
    prompts = byte_prompts(ck, PROMPTS)
    with one_thread():
        want, want_logits = reference_tokens(model_dir, prompts, NEW)
        got = generate(ck, "resident", row_format, device, prompts, NEW)
    failures, exact, worst = [], 0, 0.0
    for i in range(len(prompts)):
        exact += want[i] == got.tokens[i]
        diff = float((want_logits[i] - got.first_logits[i]).abs().max())
        worst = max(worst, diff)
        bad = tie_aware_mismatch(want[i], got.tokens[i], got.gaps[i])
        if bad or diff > LOGIT_TOL:
            failures.append(f"prompt {i}: {bad or 'tokens ok'}, first-step logit diff {diff:.2e}")
    line = (
        f"{ck.cfg.arch} on {device}: {exact}/{len(prompts)} prompts token-identical to "
        f"transformers, max first-step logit diff {worst:.1e}"
    )
    return line, failures


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_gives_transformers_greedy_tokens(made, arch, capsys):
    line, failures = compare_with_transformers(made[arch], CPU)
    with capsys.disabled():
        print(f"\n{line}")
    assert not failures, f"{line}; " + "; ".join(failures)
