"""Hybrid residency in the DSA engine on a GPU (marked ``cuda``; skipped without a GPU and the
CUDA build): with a device budget that forces spills mid-generation, spilled admissions and
returns, hybrid tokens are bit-identical to resident tokens on the same GPU for both
architectures, f32 rows (torch math) and fp8 rows (the core's Triton kernels), and the spills
are the ones the CPU run makes (the policy reads token counts only). Both run eagerly there, so
the two differ only in where the rows live; replayed from CUDA graphs (a graph per split of the
batch) hybrid tokens equal resident's replayed tokens. The page-table kernel equals its torch
reference."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.generate import byte_prompts, generate
from hisparse.engine.dsa.stores import BLOCK
from hisparse.models.dsa.kernels.pages import page_rows, page_rows_torch
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


def _run(ck, device, mode: str, row_format: str, graphs: bool = False, **kw):
    prompts = byte_prompts(ck, PROMPTS)
    return generate(
        ck, mode, row_format, device, prompts, NEW, max_batch=BATCH, graphs=graphs, **kw
    )


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


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_graph_replays_equal_resident_replays(checkpoints, arch):
    """Decode steps replayed from CUDA graphs in both modes: a graph per batch size and split
    (resident decodes, spilled ones) while spills and returns move requests between them."""
    ck = load_checkpoint(checkpoints[arch], GPU)
    res = _run(ck, GPU, "resident", "fp8", graphs=True)
    hy = _run(ck, GPU, "hybrid", "fp8", graphs=True, device_blocks=BUDGET)
    c = hy.counters
    assert res.graph_replays > 0 and hy.graph_replays > 0, (res.graph_replays, hy.graph_replays)
    assert hy.spills >= 1 and c["returns"] >= 1 and c["misses"] > 0, c
    assert hy.tokens == res.tokens, f"{arch}: replayed hybrid tokens differ from resident: {c}"
    # a budget that holds every request and two hot buffers: the replays never touch the host pool
    few = _run(ck, GPU, "hybrid", "fp8", graphs=True, device_blocks=64, hot_slots=2)
    assert few.spills == 0 and few.graph_replays > 0 and few.tokens == res.tokens
    # one block: every request spilled, every step through the host pool
    host = _run(ck, GPU, "hybrid", "fp8", graphs=True, device_blocks=1)
    assert host.counters["spilled_requests"] == PROMPTS and host.graph_replays > 0
    assert host.tokens == res.tokens


def test_page_rows_kernel_equals_its_torch_reference():
    g = torch.Generator(device=GPU).manual_seed(0)
    context, slots = 64 * BLOCK, 5
    table = torch.randint(0, 1 << 20, (slots, context // BLOCK), generator=g, device=GPU)
    for shape in [(1, 7), (3, 2048), (4097,), (0, 5)]:
        keys = torch.randint(-1, slots * context, shape, generator=g, device=GPU)
        assert torch.equal(page_rows(keys, table, BLOCK), page_rows_torch(keys, table, BLOCK))


def test_a_hybrid_forward_never_syncs(tmp_path):
    """Every forward of a hybrid run (resident and spilled requests in one batch), eager and
    captured, under ``set_sync_debug_mode("error")``; dense layers, as in test_cuda.py (the
    reference MoE reads its experts' ids on the host)."""
    ck = dense_checkpoint(tmp_path, GPU)
    calls = []
    strict = strict_hook(calls)

    prompts = byte_prompts(ck, 4)
    run = generate(
        ck, "hybrid", "fp8", GPU, prompts, 8, max_batch=3, step_hook=strict, device_blocks=6
    )
    assert calls and all(len(t) == 8 for t in run.tokens)
    assert run.counters["spilled_requests"] >= 1, run.counters  # a mixed batch ran
    assert run.graph_replays > 0
