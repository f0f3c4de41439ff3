"""Hybrid residency in the DSA engine on a GPU (marked ``cuda``; skipped without a GPU and the
CUDA build): with a device budget that forces spills mid-generation, spilled admissions and
returns, hybrid tokens are bit-identical to resident tokens on the same GPU for both
architectures, f32 rows (torch math) and fp8 rows (the core's Triton kernels), and the spills
are the ones the CPU run makes (the policy reads token counts only). Hybrid steps run eagerly;
resident runs eagerly too here, so the two differ only in where the rows live."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.generate import byte_prompts, generate
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.weights import load_checkpoint
from tests.devices import needs_cuda
from tests.engine.dsa.helpers import ARCHS, dense_checkpoint, one_thread, strict_hook

pytestmark = [pytest.mark.cuda, needs_cuda]

CPU, GPU = torch.device("cpu"), torch.device("cuda")
# As tests/engine/dsa/test_hybrid.py: 5 requests through a batch of 3, 40 tokens each, 12 blocks.
PROMPTS, NEW, BATCH, BUDGET = 5, 40, 3, 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa_hybrid_cuda")
    return {a: write_random_checkpoint(root / a, a, seed=3) for a in ARCHS}


def _run(ck, device, mode: str, row_format: str, **kw):
    prompts = byte_prompts(ck, PROMPTS)
    return generate(ck, mode, row_format, device, prompts, NEW, max_batch=BATCH, graphs=False, **kw)


@pytest.mark.parametrize("row_format", ["f32", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_tokens_equal_resident_tokens_on_cuda(checkpoints, arch, row_format):
    ck = load_checkpoint(checkpoints[arch], GPU)
    res = _run(ck, GPU, "resident", row_format)
    hy = _run(ck, GPU, "hybrid", row_format, device_blocks=BUDGET)
    c = hy.counters
    assert hy.spills >= 1 and c["spilled_requests"] > hy.spills and c["returns"] >= 1, c
    assert c["misses"] > 0, c
    assert hy.tokens == res.tokens, (
        f"{arch} {row_format}: hybrid tokens differ from resident tokens on the GPU (same "
        f"bytes, same order must give the same bits): {c}"
    )
    with one_thread():
        cpu = _run(load_checkpoint(checkpoints[arch], CPU), CPU, "hybrid", row_format,
                   device_blocks=BUDGET)  # fmt: skip
    # the policy decides from token counts only: the same moves on both devices
    moves = ("spills", "spilled_requests", "spilled_rows", "returns", "returned_rows")
    assert {k: c[k] for k in moves} == {k: cpu.counters[k] for k in moves}


def test_a_hybrid_forward_never_syncs(tmp_path, caplog):
    """Every forward of a hybrid run (resident and spilled requests in one batch) under
    ``set_sync_debug_mode("error")``; dense layers, as in test_cuda.py (the reference MoE reads
    its experts' ids on the host). The run says in a log line that it steps eagerly."""
    ck = dense_checkpoint(tmp_path, GPU)
    calls = []
    strict = strict_hook(calls)

    prompts = byte_prompts(ck, 4)
    with caplog.at_level("INFO", logger="hisparse.engine.dsa.generate"):
        run = generate(
            ck, "hybrid", "fp8", GPU, prompts, 4, max_batch=3, step_hook=strict, device_blocks=6
        )
    assert "run eagerly" in caplog.text
    assert calls and all(len(t) == 4 for t in run.tokens)
    assert run.counters["spilled_requests"] >= 1, run.counters  # a mixed batch ran
