"""DeepGEMM's paged FP8 MQA logits (DeepSeek's kernel; a CUDA vLLM ships it) as the indexer's
scores, where a build of it is importable, and the measurement that picks it.

Why: on an H200 it scored a batch's keys in about half the time of the project's Triton kernel
(1.4-2.0x, both timed as graph replays: benchmarks/results/kernels_vs_baselines_h200.md), and the
indexer was 2.2 of the 7.3 us a request-layer cost at 32k. Its paged key cache is the project's
fp8 index key layout byte for byte (a block's fp8 keys, then their float32 scales: vLLM's), so
it reads the cache in place.

Numerics: it takes FP8 queries. Each token's head is quantized with its own scale (amax / 448),
as vLLM and DeepSeek-V3.2's reference inference quantize them, and the scale moves into the head
weight (relu(c x) = c relu(x), c > 0). Scores then differ from the Triton kernel's (bfloat16
queries) by that rounding; both residency modes call the same kernel, so they still give the
same bits.

Around the kernel, one Triton launch prepares its inputs (the FP8 queries, their weights, the
lengths, the block table rows: ``fp8_queries.prepare``) and one masks past each position, so a
call is four launches with DeepGEMM's two. In torch those were 17 more, and took back all it
gained: 31.1 against the Triton kernel's 6.9 us at 1 token x 16k keys, 79.2 against 76.9 at 64.

The choice ("auto"): both are timed as graph replays at each ``PROBE`` shape after their scores
are checked to agree, and DeepGEMM is taken where its times summed over the shapes are below the
Triton kernel's: a serving batch's step, not a lone token's, is most of the time.

Sources, tried in order: the ``deep_gemm`` package, then the copy a vLLM wheel vendors. Each
must offer ``get_paged_mqa_logits_metadata`` and ``fp8_fp4_paged_mqa_logits`` (or the older
``fp8_paged_mqa_logits``). Its scheduling kernel is compiled per batch size rounded up to 32
(DeepGEMM's JIT, cached on disk), so an eager step at a new size pays one compile.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from hisparse.models.dsa.kernels import fp8_queries
from hisparse.models.dsa.kernels.probe import first_module, replay_us
from hisparse.models.dsa.kernels.rows import available

log = logging.getLogger("hisparse")
_SOURCES = ["deep_gemm", "vllm.third_party.deep_gemm"]
_CHOICE: dict = {}  # (device, heads, dim) -> "deepgemm" | "triton"
BLOCK = 64  # keys per cache block the SM90 kernel takes (vLLM's for DeepSeek-V3.2)
PROBE = ((1, 16384), (64, 16384))  # (tokens, keys) timed at start-up
AGREE = 0.05  # probe scores within 5 % of the largest: an FP8 query, not a wrong call


def supported(heads: int, dim: int, device) -> bool:
    """Shapes DeepGEMM's paged logits take on ``device`` (SM90: 32 or 64 heads)."""
    device = torch.device(device)
    if device.type != "cuda" or dim not in (32, 64, 128):
        return False
    major = torch.cuda.get_device_capability(device)[0]
    return heads in ((32, 64) if major == 9 else (8, 16, 32, 64) if major == 10 else ())


class DeepGEMMScores:
    """``kernels.indexer.paged_scores``'s contract over DeepGEMM's kernel: float32 [T, L]
    scores, -inf past each token's position."""

    def __init__(self, module) -> None:
        self.name = module.__name__
        self._meta = module.get_paged_mqa_logits_metadata
        both = getattr(module, "fp8_fp4_paged_mqa_logits", None)
        legacy = getattr(module, "fp8_paged_mqa_logits", None)
        # Newer builds (vLLM 0.33's) take (values, scales) and no clean_logits; older ones the
        # values and a clean_logits flag. Neither cleans what the mask below covers.
        if both is not None:
            self._logits = lambda q, *a: both((q, None), *a)
        else:
            self._logits = lambda q, *a: legacy(q, *a, False)
        self._sms = getattr(module, "get_num_sms", None)

    def __call__(self, q, hw, cache, block_table, block_size, req, positions) -> torch.Tensor:
        T, H, D = q.shape
        L = block_table.shape[1] * block_size
        if T == 0:
            return torch.empty(0, L, dtype=torch.float32, device=q.device)
        # in torch these inputs and the mask were 17 launches, more time than DeepGEMM saved
        fused = available(q.device)
        prep = fp8_queries.prepare if fused else fp8_queries.prepare_torch
        # one row of the batch per token (an MTP verify step has two per request)
        q8, w, lens, bt = prep(q, hw, block_table, req, positions)
        sms = self._sms() if self._sms else _device_sms(q.device)
        meta = self._meta(lens, block_size, sms)
        kv = cache.view(cache.shape[0], block_size, 1, D + 4)
        out = self._logits(q8.view(T, 1, H, D), kv, w, lens, bt, meta, L)
        # past a token's own position the kernel leaves the buffer as it was
        if fused and out.stride(1) == 1:
            return fp8_queries.mask_past(out, positions)
        return fp8_queries.mask_past_torch(out, positions)


def _device_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def find() -> Optional[DeepGEMMScores]:
    """The first importable source offering the paged logits, or None."""
    module = first_module(_SOURCES, _offers_paged_logits)
    return None if module is None else DeepGEMMScores(module)


def _offers_paged_logits(module) -> bool:
    logits = any(hasattr(module, f) for f in ("fp8_paged_mqa_logits", "fp8_fp4_paged_mqa_logits"))
    return logits and hasattr(module, "get_paged_mqa_logits_metadata")


def pick(indexer: str, paged: bool, cfg, device, triton_scores) -> tuple:
    """(name, scores function) for the core's ``indexer`` setting: DeepGEMM where asked for or
    measured faster over the probe shapes ("auto"), else the project's kernel; ("torch", None)
    where the keys are not ``paged`` fp8 on a device with the kernels."""
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    if not paged:
        if indexer == "deepgemm":
            raise ValueError("indexer='deepgemm' needs fp8 index keys on a CUDA device with Triton")
        return "torch", None
    if indexer == "auto" and supported(heads, dim, device):
        indexer = choose(device, heads, dim, triton_scores)
    if indexer != "deepgemm":
        return "triton", triton_scores
    found = find() if supported(heads, dim, device) else None
    if found is None:
        raise ValueError(
            f"indexer='deepgemm' needs DeepGEMM importable and {heads} index heads x {dim} on "
            f"{device} (SM90: 32 or 64 heads; dims 32, 64, 128); pass indexer='triton'"
        )
    return "deepgemm", found


def choose(device, heads: int, dim: int, triton_scores) -> str:
    """ "deepgemm" where a source exists, takes the shape, agrees with ``triton_scores`` (the
    project's kernel, ``paged_scores``'s signature) and its times summed over the probe shapes
    are below the Triton kernel's, else "triton"; measured once per device and shape, said in
    one log line."""
    key = (torch.device(device), heads, dim)
    if key in _CHOICE:
        return _CHOICE[key]
    found = find() if supported(heads, dim, device) else None
    if found is None:
        why = "no DeepGEMM importable" if find() is None else f"DeepGEMM lacks {heads} x {dim}"
        log.info("hisparse: indexer scores by the Triton kernel (%s)", why)
        _CHOICE[key] = "triton"
        return "triton"
    try:
        times = {p: _probe(found, triton_scores, device, heads, dim, *p) for p in PROBE}
    except Exception as e:  # noqa: BLE001 - a build that fails here must not serve
        log.warning("hisparse: indexer scores by the Triton kernel (DeepGEMM from %s failed "
                    "its probe: %s: %s)", found.name, type(e).__name__, e)  # fmt: skip
        _CHOICE[key] = "triton"
        return "triton"
    # A summed step, not every shape: a serving batch's step (64 tokens) is most of the time,
    # so a few microseconds lost at one token are worth a larger gain there.
    deep, trit = sum(d for d, _ in times.values()), sum(t for _, t in times.values())
    won = deep < trit
    _CHOICE[key] = "deepgemm" if won else "triton"
    said = ", ".join(f"{d:.1f} vs {t:.1f} us at {n} x {k} keys" for (n, k), (d, t) in times.items())
    who = "DeepGEMM" if won else "the Triton kernel"
    log.info("hisparse: indexer scores by %s (DeepGEMM from %s against the Triton kernel: %s; "
             "the lower sum over these shapes wins: %.1f vs %.1f us)",
             who, found.name, said, deep, trit)  # fmt: skip
    return _CHOICE[key]


def _probe(found, triton_scores, device, heads, dim, tokens, keys) -> tuple:
    """Replayed microseconds of (DeepGEMM, Triton) on random keys, after checking they agree."""
    from hisparse.models.dsa.kernels.indexer import store_fp8_keys

    g = torch.Generator(device=device).manual_seed(0)
    blocks = tokens * keys // BLOCK
    cache = torch.empty(blocks, BLOCK * (dim + 4), dtype=torch.uint8, device=device)
    slots = torch.arange(tokens * keys, device=device)
    store_fp8_keys(cache, slots, torch.randn(tokens * keys, dim, device=device, generator=g), BLOCK)
    q = torch.randn(tokens, heads, dim, device=device, generator=g).bfloat16()
    hw = torch.rand(tokens, heads, device=device, generator=g) * (heads * dim) ** -0.5
    bt = torch.arange(blocks, device=device, dtype=torch.int32).view(tokens, -1)
    req = torch.arange(tokens, device=device)
    pos = torch.full((tokens,), keys - 1, device=device) - req  # a ragged last block
    args = (q, hw, cache, bt, BLOCK, req, pos)
    want, got = triton_scores(*args), found(*args)
    seen = torch.isfinite(want)
    if not torch.equal(seen, torch.isfinite(got)):
        raise ValueError("its scores are finite at other positions than the Triton kernel's")
    gap = (got[seen] - want[seen]).abs().max() / want[seen].abs().max().clamp_min(1e-30)
    if gap > AGREE:
        raise ValueError(f"its scores differ from the Triton kernel's by {gap:.3f} of the largest")
    return replay_us(lambda: found(*args)), replay_us(lambda: triton_scores(*args))
