"""Registers, spills and shared memory of the graph engine's Triton kernels, compiled for sm_90a
on any machine (no GPU needed): Triton lowers each kernel to PTX and its bundled ptxas reports
what a launch would use. Spilled registers and shared memory over 227 KB (which fails to launch
on an H200) show up here before a device run does.

    python benchmarks/kernel_resources.py --out benchmarks/results/triton_kernels_sm90.md

Uses Triton's compiler entry points (ASTSource, GPUTarget). Run it with the Triton the H200 image
has (`pip install triton==3.6.0` in a venv of its own): the ptxas bundled with Triton 3.9 rejects
the PTX version that release emits.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hisparse.engine.graph import kernels as K
from hisparse.engine.graph import miss_kernels as MK
from hisparse.models.dsa.kernels import mla as ML
from hisparse.models.rows import FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM

RB = K.ROW_BYTES
ROW = dict(ROW_U8=RB, ROW_F32=RB // 4, ROW_BF16=RB // 2, SCALE0=K.SCALE_AT, ROPE0=K.ROPE_AT)
MLA_SIG = dict(
    q="*bf16", src_u8="*u8", src_f32="*fp32", src_bf16="*bf16", ids="*i64", out="*bf16",
    part_acc="*fp32", part_ml="*fp32", K="i32", CHUNK="i32", scale="fp32",
)  # fmt: skip


def cases():
    """(name, kernel, signature, constexprs, warps, stages): each kernel at the launch shapes the
    engine and its benchmarks use."""
    gd = dict(
        src_u8="*u8", src_f32="*fp32", src_bf16="*bf16", ids="*i32", out="*bf16", n="i32",
        pending="*i32",
    )  # fmt: skip
    for part in ("all", "hits", "misses"):
        const = dict(**ROW, LAT=LATENT_DIM, ROPE=ROPE_DIM, TILE=FP8_TILE, OUT_W=KV_DIM, BLOCK=16)
        yield (
            f"gather_decode part={part}",
            K._gather_decode,
            gd,
            {**const, "PART": K.PARTS[part]},
            4,
            3,
        )
    idx = dict(q="*bf16", hw="*bf16", keys="*fp8e4nv", scales="*fp32", out="*fp32", ctx="i32")
    for bt, tiles in ((128, 1), (64, 4)):
        yield (
            f"indexer {bt}x{tiles}x4",
            K._indexer,
            idx,
            dict(H=64, D=128, BLOCK_T=bt, TILES=tiles),
            4,
            3,
        )
    rh = dict(
        hot_u8="*u8", hot_f32="*fp32", hot_bf16="*bf16", host_u8="*u8", host_f32="*fp32",
        host_bf16="*bf16", pending="*i32", ids="*i32", out="*bf16", n="i32",
    )  # fmt: skip
    const = dict(**ROW, ROPE=ROPE_DIM, TILES=LATENT_DIM // FP8_TILE, TILE=FP8_TILE, OUT_W=KV_DIM)
    for blk, w in ((64, 8), (32, 8), (16, 4)):
        yield f"read_host_misses {blk}x{w}", MK._read_host_misses, rh, {**const, "BLOCK": blk}, w, 3
    plan = dict(
        pending="*i32", miss_src="*i32", miss_dst="*i32", miss_count="*i32", moved="*i64", K="i32"
    )
    const = dict(BLOCK=1024, CLEAR=True, COUNT=True, ROW=RB)
    yield "stage_misses", MK._stage_misses, plan, const, 4, 3
    cp = dict(
        hot="*i32", host="*i32", miss_src="*i32", miss_dst="*i32", miss_count="*i32", B="i32",
        K="i32",
    )  # fmt: skip
    for blk, w in ((64, 16), (32, 8)):
        yield (
            f"copy_misses {blk}x{w}",
            MK._copy_misses,
            cp,
            dict(WORDS=164, WPAD=256, BLOCK=blk),
            w,
            3,
        )
    for hb, bn, w, st in ((64, 16, 8, 2), (64, 16, 8, 1), (64, 32, 8, 2), (32, 16, 8, 1),
                          (16, 32, 8, 2), (16, 16, 8, 1)):  # fmt: skip
        const = dict(H=128, HB=hb, BN=bn, SPLITS=1, **ROW, LAT=LATENT_DIM, ROPE=ROPE_DIM,
                     TILE=FP8_TILE, DOT=tl.bfloat16)  # fmt: skip
        yield f"sparse_mla {hb}x{bn}x{w}x{st}", ML._sparse_mla, MLA_SIG, const, w, st
    comb = dict(part_acc="*fp32", part_ml="*fp32", out="*bf16")
    yield "combine", ML._combine, comb, dict(H=128, HB=16, SPLITS=4, LAT=LATENT_DIM), 8, 3


def resources(kernel, signature, constexprs, warps, stages) -> dict:
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    target = GPUTarget("cuda", 90, 32)
    k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        run = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True
        )
    if run.returncode:
        raise RuntimeError(run.stderr[-500:])
    ptx = k.asm["ptx"]
    return dict(
        registers=int(re.findall(r"Used (\d+) registers", run.stderr)[0]),
        spill_bytes=int(re.findall(r"(\d+) bytes spill stores", run.stderr)[0]),
        shared_kib=k.metadata.shared / 1024,
        mma="wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lines = [
        "# Triton kernels of hisparse.engine.graph compiled for sm_90a "
        f"(Triton {triton.__version__}, no GPU)",
        "",
        "| kernel (shape) | warps | stages | registers | spill stores (B) | shared KiB | MMA |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, kernel, sig, const, warps, stages in cases():
        r = resources(kernel, sig, const, warps, stages)
        lines.append(
            f"| {name} | {warps} | {stages} | {r['registers']} | {r['spill_bytes']} | "
            f"{r['shared_kib']:.0f} | {r['mma']} |"
        )
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
