"""The DSA engine against transformers (skipped where transformers or its DeepSeek-V3.2 / GLM-5
classes are absent): on tiny checkpoints made by transformers itself
(``hisparse.models.dsa.make_checkpoint``), unquantized (f32) rows give transformers' greedy
tokens (eager attention, float32) for 8 prompts x 16 new tokens per architecture, compared up
to the first near-tie step, and first-step logits within ``helpers.LOGIT_TOL``; so do checkpoints
of other latent sizes (``helpers.OTHER_SIZES``), resident and HiSparse.

Why the tolerance: both run float32 but sum differently (the engine attends over latent rows
with the absorbed query, transformers expands keys and values per head), so logits differ by
float32 rounding through 4 layers: about 3e-5 here for logits of magnitude ~10. 1e-3 is 30
times that and still 50 times below the near-tie gap (0.05) that decides the tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.dsa.helpers import ARCHS, OTHER_SIZES, compare_with_transformers

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GlmMoeDsaConfig") or not hasattr(transformers, "DeepseekV32Config"):
    pytest.skip("transformers lacks DeepseekV32 / GlmMoeDsa", allow_module_level=True)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from hisparse.models.dsa.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("hf")
    out = {a: make_checkpoint(root / a, a, seed=0) for a in ARCHS}
    out.update(
        {(a, "other"): make_checkpoint(root / f"{a}-other", a, 0, **OTHER_SIZES[a]) for a in ARCHS}
    )
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_gives_transformers_greedy_tokens(made, arch, capsys):
    line, failures = compare_with_transformers(made[arch], CPU)
    with capsys.disabled():
        print(f"\n{line}")
    assert not failures, f"{line}; " + "; ".join(failures)


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
@pytest.mark.parametrize("arch", ARCHS)
def test_other_latent_sizes_give_transformers_greedy_tokens(made, arch, mode, capsys):
    line, failures = compare_with_transformers(made[arch, "other"], CPU, mode)
    with capsys.disabled():
        print(f"\n{OTHER_SIZES[arch]}: {line}")
    assert not failures, f"{line}; " + "; ".join(failures)
