"""The DSA engine on a GPU (marked ``cuda``; skipped without a GPU and the CUDA build): for tiny
DeepSeek-V3.2 and GLM-5 checkpoints (made by transformers when it is installed, else written
without it), run batched (requests of different lengths join and leave), CUDA tokens equal CPU
tokens and transformers' (f32 rows), resident and HiSparse tokens on the GPU are bit-identical
in the f32 and fp8 row formats (fp8: the Triton kernels of the core), a decode step never
synchronises with the host, and the HiSparse run takes the device-side paths a CUDA vLLM takes:
every new row saved with a slot mapping that stays on the GPU (``host_save._save_cuda`` sees
CUDA slots), prefill reads gathered from the pinned host pool, decode reads resolved into the
hot buffers.

CPU and CUDA float32 differ in rounding, so tokens are compared up to the first near-tie step
(``helpers.NEAR_TIE``) and first-step logits within a tolerance; resident vs HiSparse on one
device read the same bytes in the same order and must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.generate import byte_prompts, generate
from hisparse.engine.dsa.stores import HiSparseRows, nothing
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.weights import load_checkpoint
from tests.devices import needs_cuda
from tests.engine.dsa.helpers import (
    ARCHS,
    OTHER_SIZES,
    compare_with_transformers,
    dense_checkpoint,
    one_thread,
    strict_hook,
    tie_aware_mismatch,
)

pytestmark = [pytest.mark.cuda, needs_cuda]

CPU, GPU = torch.device("cpu"), torch.device("cuda")
# Eight requests of different lengths through a batch of five: requests join and leave.
PROMPTS, NEW, BATCH = 8, 16, 5
#: CUDA vs CPU first-step logits: f32 rows carry only float32 rounding (about 1e-5 here). An fp8
#: row may round a latent value to the neighbouring fp8 step on one device and not the other, and
#: one e4m3 step is an eighth of the value: on the H200 such flips moved first-step logits by up
#: to 0.17 (0.068 DeepSeek-V3.2, 0.169 GLM-5, 4 prompts each), so fp8 gets 0.3. The tokens are
#: compared exactly (tie-aware) above; the tolerance only bounds how far a flip may move logits.
LOGIT_TOL = {"f32": 1e-3, "fp8": 0.3}


def _has_dsa_transformers() -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return hasattr(transformers, "DeepseekV32Config") and hasattr(transformers, "GlmMoeDsaConfig")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa_cuda")
    if _has_dsa_transformers():
        from hisparse.models.dsa.make_checkpoint import make_checkpoint

        return {a: make_checkpoint(root / a, a, seed=0) for a in ARCHS}
    return {a: write_random_checkpoint(root / a, a, seed=0) for a in ARCHS}


@pytest.fixture
def spy(monkeypatch):
    """Counts the device-side connector paths the HiSparse run takes."""
    import hisparse.connector.host_save as host_save

    seen = {"save_slots": [], "prefill_reads": [], "decode_reads": 0}
    real_save = host_save._save_cuda
    real_prefill, real_decode = HiSparseRows.prefill_rows, HiSparseRows.decode_rows

    def save(rt, rows, slots):
        seen["save_slots"].append(slots.device.type)
        real_save(rt, rows, slots)

    def prefill(self, layer, keys):
        src, ids = real_prefill(self, layer, keys)
        seen["prefill_reads"].append(src.device.type)
        return src, ids

    def decode(self, layer, keys, defer_misses=False, *, beside=nothing):
        seen["decode_reads"] += 1
        return real_decode(self, layer, keys, defer_misses, beside=beside)

    monkeypatch.setattr(host_save, "_save_cuda", save)
    monkeypatch.setattr(HiSparseRows, "prefill_rows", prefill)
    monkeypatch.setattr(HiSparseRows, "decode_rows", decode)
    return seen


def _steps(prompts: int, new: int, batch: int) -> tuple:
    """(steps, steps with decodes) of ``generate``'s schedule: one admission per step."""
    steps, running, waiting, decodes = 0, [], prompts, 0
    while waiting or running:
        decodes += bool(running)
        admitted = 1 if waiting and len(running) < batch else 0
        waiting -= admitted
        running = [n + 1 for n in running] + [1] * admitted
        running = [n for n in running if n < new]
        steps += 1
    return steps, decodes


@pytest.mark.parametrize("row_format", ["f32", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_tokens_equal_cpu_tokens_and_hisparse_equals_resident(
    checkpoints, spy, arch, row_format
):
    d = checkpoints[arch]
    ck_cpu, ck_gpu = load_checkpoint(d, CPU), load_checkpoint(d, GPU)
    prompts = byte_prompts(ck_cpu, PROMPTS)
    with one_thread():
        cpu = generate(
            ck_cpu, "resident", row_format, CPU, prompts, NEW, max_batch=BATCH, key_format="f32"
        )
    # eager steps: the spy counts the Python calls a replayed graph skips
    res = generate(ck_gpu, "resident", row_format, GPU, prompts, NEW, max_batch=BATCH, graphs=False)
    his = generate(ck_gpu, "hisparse", row_format, GPU, prompts, NEW, max_batch=BATCH, graphs=False)
    # fp8 rows and keys run the Triton kernels on CUDA (bf16 products, tested against the torch
    # path in tests/models/dsa/test_core_cuda.py); CPU tokens compare with the same float32
    # math on the GPU, which the unquantized formats run anyway. The index keys stay unquantized
    # there: a key computed a rounding apart on two devices may land on two fp8 steps, which
    # moves its score enough to swap a selected position (seen on the H200: a token 13 steps
    # in, at a logit gap of 0.58).
    ref = generate(
        ck_gpu, "resident", row_format, GPU, prompts, NEW, max_batch=BATCH, backend="torch",
        key_format="f32",
    )  # fmt: skip
    assert his.tokens == res.tokens, (
        f"{arch} {row_format}: HiSparse tokens differ from resident tokens on the GPU "
        f"(same bytes, same order must give the same bits): resident {res.tokens} hisparse "
        f"{his.tokens}"
    )
    layers = ck_cpu.cfg.num_layers
    steps, decode_steps = _steps(PROMPTS, NEW, BATCH)
    assert spy["save_slots"] == ["cuda"] * (layers * steps), (
        "every HiSparse save must reach host_save._save_cuda with a CUDA slot mapping "
        f"({layers} layers x {steps} steps); saw {spy['save_slots'][:8]}..."
    )
    assert spy["prefill_reads"] == ["cuda"] * (layers * PROMPTS), spy["prefill_reads"]
    assert spy["decode_reads"] == layers * decode_steps
    assert his.counters["hits"] + his.counters["misses"] > 0, his.counters
    for i in range(PROMPTS):
        # fp8 rows: a flip to the neighbouring fp8 step on one device moves later steps' logits
        # further each step (on the H200 a token 4 steps in, at a gap of 0.57, after the scales'
        # arithmetic changed by an ulp), so only the first step's logits are bounded there.
        if row_format == "f32":
            bad = tie_aware_mismatch(cpu.tokens[i], ref.tokens[i], cpu.gaps[i], ref.gaps[i])
            assert bad is None, f"{arch} {row_format} prompt {i}: CUDA vs CPU tokens, {bad}"
        diff = float((cpu.first_logits[i] - ref.first_logits[i]).abs().max())
        assert diff <= LOGIT_TOL[row_format], (
            f"{arch} {row_format} prompt {i}: CUDA vs CPU first-step logits differ by {diff:.2e}"
        )


@pytest.mark.parametrize(
    "arch, row_format",
    [
        ("deepseek_v32", "f32"),
        ("deepseek_v32", "fp8"),
        ("glm_moe_dsa", "f32"),
        ("glm_moe_dsa", "bf16"),
    ],
)
def test_other_latent_sizes_on_cuda(tmp_path, arch, row_format):
    """Rows of other sizes than 512 + 64 (``helpers.OTHER_SIZES``; padded to 16 B) take the
    torch math on CUDA, the kernels only where they fit (the indexer, the gathers): HiSparse
    equals resident on the GPU exactly, replayed from graphs, and f32 tokens equal the CPU's."""
    d = write_random_checkpoint(tmp_path / arch, arch, seed=2, **OTHER_SIZES[arch])
    ck_cpu, ck_gpu = load_checkpoint(d, CPU), load_checkpoint(d, GPU)
    prompts = byte_prompts(ck_cpu, PROMPTS)
    run = {
        m: generate(ck_gpu, m, row_format, GPU, prompts, NEW, max_batch=BATCH)
        for m in ("resident", "hisparse")
    }
    assert run["hisparse"].tokens == run["resident"].tokens
    assert run["hisparse"].counters["misses"] > 0 and run["hisparse"].graph_replays > 0
    if row_format == "f32":
        with one_thread():
            cpu = generate(
                ck_cpu, "resident", "f32", CPU, prompts, NEW, max_batch=BATCH, key_format="f32"
            )
        ref = generate(
            ck_gpu, "resident", "f32", GPU, prompts, NEW, max_batch=BATCH, key_format="f32"
        )
        for i in range(PROMPTS):
            bad = tie_aware_mismatch(cpu.tokens[i], ref.tokens[i], cpu.gaps[i], ref.gaps[i])
            assert bad is None, f"{arch} prompt {i}: CUDA vs CPU tokens, {bad}"


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_a_decode_step_never_syncs(tmp_path, mode, graphs):
    """Every forward of a batched run under ``set_sync_debug_mode("error")``: a host sync in
    the step (a ``.item()``, a ``.cpu()``, a blocking copy) raises. The checkpoint's layers are
    dense: the engine's reference MoE reads its experts' ids on the host (the vLLM classes use
    vLLM's fused MoE)."""
    ck = dense_checkpoint(tmp_path, GPU)
    calls = []
    strict = strict_hook(calls)

    prompts = byte_prompts(ck, 4)
    run = generate(ck, mode, "fp8", GPU, prompts, 4, max_batch=3, step_hook=strict, graphs=graphs)
    assert len(calls) == _steps(4, 4, 3)[0]
    assert all(len(t) == 4 for t in run.tokens)
    assert (run.graph_replays > 0) == graphs  # the capture and the replays ran under the check


@pytest.mark.parametrize("row_format", ["f32", "fp8"])
@pytest.mark.parametrize("mode", ["resident", "hisparse"])
@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_decode_steps_equal_eager_steps(checkpoints, arch, mode, row_format):
    """Decode steps replayed from CUDA graphs (captured per batch size) against the same run
    stepped eagerly: the same tokens, the same logit gaps every step (the same bits), and the
    same connector counters (the replays count their hits and misses)."""
    ck = load_checkpoint(checkpoints[arch], GPU)
    prompts = byte_prompts(ck, PROMPTS)
    run = {
        g: generate(ck, mode, row_format, GPU, prompts, NEW, max_batch=BATCH, graphs=g)
        for g in (False, True)
    }
    eager, replay = run[False], run[True]
    assert eager.graph_replays == 0 and replay.graph_replays >= NEW, replay.graph_replays
    assert replay.tokens == eager.tokens
    assert replay.gaps == eager.gaps
    assert replay.counters == eager.counters


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_tokens_equal_transformers(checkpoints, arch, mode, capsys):
    if not _has_dsa_transformers():
        pytest.skip("transformers with DeepseekV32 / GlmMoeDsa is not installed")
    line, failures = compare_with_transformers(checkpoints[arch], GPU, mode)
    with capsys.disabled():
        print(f"\n{line}")
    assert not failures, f"{line}; " + "; ".join(failures)


@pytest.mark.parametrize("arch", ARCHS)
def test_misses_fetched_by_the_row_read_equal_misses_gathered_first(checkpoints, arch):
    """The connector's deferred plan (``resolve(defer_misses=True)``) read by attention's row
    read against the same run whose misses the gather copied first: the same tokens, logit gaps
    and counters, replayed from graphs (fp8 rows: the only rows the in-read reads)."""
    ck = load_checkpoint(checkpoints[arch], GPU)
    prompts = byte_prompts(ck, PROMPTS)
    run = {
        m: generate(ck, "hisparse", "fp8", GPU, prompts, NEW, max_batch=BATCH, misses=m)
        for m in ("gather", "in_read")
    }
    assert run["in_read"].tokens == run["gather"].tokens
    assert run["in_read"].gaps == run["gather"].gaps
    assert run["in_read"].counters == run["gather"].counters
    assert run["in_read"].graph_replays >= NEW
