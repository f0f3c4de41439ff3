"""Sparse FP8 MLA decode beside FlashMLA's, same GPU, same inputs: DeepSeek-V3.2's 128 heads, 2048
selected 656-byte FP8 rows per request (FlashMLA's own "FP8 with scale" layout, which is the
project's fp8 row format byte for byte), one query token per request.

    bash benchmarks/baselines/build_flashmla.sh            # once per machine, no network
    PYTHONPATH=benchmarks/baselines/src/flashmla python benchmarks/baselines/bench_flashmla.py \
        --json benchmarks/results/flashmla_baseline_h200.json

Timed per launch (CUDA events, median of --reps queued calls): FlashMLA's
``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)`` and the core's attention in
the latent (``SparseMLACore.attend_latent``) with the batched-products path ("bmm", the step's
default) and the fused kernel ("fused"). Each output is checked against a float64 softmax over
the same decoded rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuda_timing import median_us  # noqa: E402

from hisparse.engine.graph import GraphConfig  # noqa: E402
from hisparse.models.dsa.core import SparseMLACore  # noqa: E402
from hisparse.models.dsa.kernels.rows import gather_decode  # noqa: E402
from hisparse.models.rows import encode_rows  # noqa: E402

BLOCK = 64  # tokens per page block of the row cache (vLLM's for DeepSeek-V3.2)


def _flashmla():
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except ImportError as e:
        sys.exit(f"flash_mla is not importable ({e}): run benchmarks/baselines/build_flashmla.sh")
    return flash_mla_with_kvcache, get_mla_metadata


def _reference(q: torch.Tensor, src: torch.Tensor, ids: torch.Tensor, scale: float):
    kv = gather_decode(src, ids.clamp(min=0)).double()  # [n, K, 576], the rows' exact values
    s = torch.einsum("nhd,nkd->nhk", q.double(), kv) * scale
    s = s.masked_fill((ids < 0)[:, None, :], float("-inf"))
    return torch.einsum("nhk,nkd->nhd", s.softmax(-1), kv[..., :512])


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,30,64,112,128")
    ap.add_argument("--context", type=int, default=32768, help="rows each request selects from")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    flash, metadata = _flashmla()
    cfg = GraphConfig.deepseek_v32()
    dsa = cfg.dsa_config()
    cores = {a: SparseMLACore(dsa, "fp8", "cuda", attention=a) for a in ("bmm", "fused")}
    H, K, R, dev = cfg.heads, cfg.top_k, args.context, "cuda"
    scale = dsa.softmax_scale
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        src = torch.empty(n * R, 656, dtype=torch.uint8, device=dev)
        for s in range(0, n * R, 1 << 18):
            e = min(n * R, s + (1 << 18))
            src[s:e] = encode_rows(torch.randn(e - s, 576, device=dev, generator=g), "fp8")
        ids = torch.stack(
            [torch.randperm(R, generator=g, device=dev)[:K].sort().values + b * R for b in range(n)]
        )
        q = (torch.randn(n, H, 576, device=dev, generator=g) * 0.5).bfloat16()
        q_lat, q_pe = q[..., :512], q[..., 512:]
        kv4 = src.view(-1, BLOCK, 1, 656)
        ids3 = ids.view(n, 1, K).to(torch.int32)
        meta, _ = metadata()

        def theirs():
            return flash(q.view(n, 1, H, 576), kv4, None, None, 512, meta,
                         softmax_scale=scale, is_fp8_kvcache=True, indices=ids3)[0]  # fmt: skip

        want = _reference(q, src, ids, scale)
        row = dict(batch=n, heads=H, top_k=K, context=R)
        row["flashmla_err"] = _err(theirs().view(n, H, 512), want)
        row["flashmla_us"] = median_us(theirs, args.reps)
        for name, core in cores.items():
            out = core.attend_latent(q_lat, q_pe, src, ids)
            row[f"{name}_err"] = _err(out, want)
            row[f"{name}_us"] = median_us(lambda c=core: c.attend_latent(q_lat, q_pe, src, ids),
                                          args.reps)  # fmt: skip
        flop = 2.0 * n * H * K * (576 + 512)
        best = min(row["bmm_us"], row["fused_us"])
        row.update(
            ours_best_us=best,
            ours_vs_flashmla=best / row["flashmla_us"],
            flashmla_tflops=flop / row["flashmla_us"] / 1e6,
            ours_tflops=flop / best / 1e6,
        )
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)  # fmt: skip
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
