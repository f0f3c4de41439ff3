"""MTP speculative decoding in the DSA engine on a GPU (marked ``cuda``; skipped without a GPU and
the CUDA build): verify steps as decodes of two query tokens, resolved through the hot buffers
as one union row per request (``hisparse.models.dsa.union``) with the union built on the device.

Per architecture and row format (f32; fp8, where the core's Triton kernels read the rows), on
the agreeing MTP checkpoint and its block-FP8 copy: speculative tokens equal plain greedy on the
GPU (up to the first near tie, as CPU and GPU orders differ), resident and HiSparse speculative
runs bit-identical (same tokens, same logit gaps: they attend over the same bytes in the same
order), only prompts read as prefill rows, the hot buffers' lookups equal to the union count,
acceptance above one half, and no rejected row read before it is written again.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.generate import byte_prompts, generate
from hisparse.engine.dsa.mtp import load_mtp
from hisparse.engine.dsa.mtp_generate import generate_mtp
from hisparse.models.dsa.mtp_checkpoint import write_mtp_checkpoint
from hisparse.models.dsa.weights import load_checkpoint
from tests.devices import needs_cuda
from tests.engine.dsa.helpers import ARCHS, tie_aware_mismatch
from tests.engine.dsa.test_mtp import StaleReadCheck

pytestmark = [pytest.mark.cuda, needs_cuda]

GPU = torch.device("cuda")
PROMPTS, NEW, BATCH = 4, 16, 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa_mtp_cuda")
    out = {}
    for a in ARCHS:
        out[a, False] = write_mtp_checkpoint(root / a, a, True)
        out[a, True] = write_mtp_checkpoint(root / f"{a}-fp8", a, True, fp8_block=(128, 128))
    return out


@pytest.mark.parametrize("row_format", ["f32", "fp8"])
@pytest.mark.parametrize("fp8_weights", [False, True], ids=["f32-weights", "fp8-weights"])
@pytest.mark.parametrize("arch", ARCHS)
def test_verify_decodes_on_cuda(checkpoints, arch, fp8_weights, row_format):
    d = checkpoints[arch, fp8_weights]
    ck = load_checkpoint(d, GPU)
    ext, head = load_mtp(d, ck, GPU)
    prompts = byte_prompts(ck, PROMPTS)
    plain = generate(ck, "resident", row_format, GPU, prompts, NEW, max_batch=BATCH)
    runs, checks = {}, {}
    for mode in ("resident", "hisparse"):

        def wrap(store, mode=mode):
            checks[mode] = StaleReadCheck(store, ext.cfg)
            return checks[mode]

        runs[mode] = generate_mtp(
            ext, head, mode, row_format, GPU, prompts, NEW, max_batch=BATCH, store_wrapper=wrap
        )
    res, his = runs["resident"], runs["hisparse"]
    line = (
        f"{arch} {'fp8' if fp8_weights else 'f32'} weights, {row_format} rows: acceptance "
        f"{his.accepted}/{his.proposed}, hot hits {his.counters.get('hits')} misses "
        f"{his.counters.get('misses')} (union keys {checks['hisparse'].lookups})"
    )
    print(line)
    for i in range(PROMPTS):
        bad = tie_aware_mismatch(plain.tokens[i], res.tokens[i], plain.gaps[i], res.gaps[i])
        assert bad is None, f"prompt {i}: {bad}; {line}"
    assert his.tokens == res.tokens and his.gaps == res.gaps, line
    total = sum(map(len, prompts))
    for mode, check in checks.items():
        assert check.prefill_tokens == [total] * ext.cfg.num_layers, (mode, line)
        assert check.stale_reads == 0
    c = his.counters
    assert c["hits"] > 0 and c["hits"] + c["misses"] == checks["hisparse"].lookups, line
    assert his.acceptance > 0.5, line
