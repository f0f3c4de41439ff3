"""Stage-by-stage timing of the CUDA resolve kernel against a baseline revision of it.

    python3 benchmarks/resolve_stages/make.py BASE_REV   # on a CUDA machine with nvcc

Writes build/ (git-ignored): the kernel of BASE_REV (renamed namespace) and the current kernel,
each with clock64 stamps at the stage boundaries of block 0's first row, compiled with main.cu;
then runs it: a bit-exact check of every variant against the baseline over a drifting trace, and
per variant the median of 100 event-timed calls (L2 flushed, GPU kept busy before each call)
with the median cycles of each stage. Variants: 512 and 1024 threads, hash capacities 2^12..2^14
for top-k 2048 (hot 4096). The baseline revision must be 182fe86 or later (the stage markers);
a baseline whose kernel is templated on <NT, FUSED, SMEM> (89b6da0 and later) is detected. Rows
repeat one key each (the rare path); DUPS=0 in the environment of the binary runs rows without.
cold.cu and dispatch.cu next to it are the cold-call and launch experiments (their headers);
blocks.py builds a per-CTA timing variant of this harness, warps.py a per-warp timeline of one
row; ncu_count.py turns an ncu source page of it into instructions per warp per stage."""

import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Stage boundaries: 1 hash, 2 hits, 3 the rest of the row (the LRU split, the miss numbering and
# the outputs; one fused pass in the current kernel, three stages in older ones).
MARKS = {
    1: ["    // 1. Hash the selected keys"],
    2: ["    // 2. Hits:"],
    3: ["    // 3. Walk the LRU order", "    const uint2 counts ="],
}
KERNEL = "\n__global__ void __launch_bounds__(NT, 1024 / NT) resolve_kernel("
HEADS = [
    f"template <{params}>{KERNEL}"
    for params in ("int NT, bool FUSED, bool SMEM", "int NT, bool FUSED", "int NT")
]
ENDS = [
    "    if (r + static_cast<int>(gridDim.x) < a.B) __syncthreads();  // scratch is reused\n  }\n}",
    "    __syncthreads();  // scratch is reused by the next row\n  }\n}",
]


def first_of(src: str, options: list[str]) -> str:
    for m in options:
        if m in src:
            return m
    raise SystemExit(f"none of {options!r} in the kernel source")


def stamp(src: str, arr: str) -> str:
    """clock64 stamps into `arr` at the stage boundaries of block 0's first row: [0] row start,
    [1] hash, [2] hits, [3] the rest, [4] row end; the kernel gains a trailing `bool STAMP`."""
    for k, options in MARKS.items():
        m = first_of(src, options)
        at = f"    if (STAMP && blockIdx.x == 0 && tid == 0 && r == 0) {arr}[{k}] = clock64();\n"
        src = src.replace(m, at + m)
    head = first_of(src, HEADS)
    src = src.replace(head, head.replace(">\n__global__", ", bool STAMP = false>\n__global__"))
    loop = "  for (int r = blockIdx.x; r < a.B; r += gridDim.x) {\n"
    src = src.replace(
        loop, f"  if (STAMP && blockIdx.x == 0 && tid == 0) {arr}[0] = clock64();\n" + loop, 1
    )
    end = first_of(src, ENDS)
    src = src.replace(
        end,
        end[:-4]
        + f"    if (STAMP && blockIdx.x == 0 && tid == 0 && r == 0) {arr}[4] = clock64();\n"
        + "  }\n}",
        1,
    )
    assert src.count(arr + "[") == 5
    return f"__device__ long long {arr}[16];\n" + src


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    rev = sys.argv[1]
    out = HERE / "build"
    out.mkdir(exist_ok=True)

    def show(path):
        git = ["git", "-C", str(ROOT), "show", f"{rev}:{path}"]
        return subprocess.run(git, check=True, capture_output=True, text=True).stdout

    oh = show("csrc/cuda/kernels.cuh").replace(
        '#include "hisparse_limits.h"',
        '#include "hisparse_limits.h"\nnamespace hisparse_old { using namespace ::hisparse; }',
    )
    (out / "kernels_old.cuh").write_text(
        oh.replace("namespace hisparse {", "namespace hisparse_old {")
    )
    oc = show("csrc/cuda/kernels.cu").replace(
        '#include "kernels.cuh"', '#include "kernels_old.cuh"'
    )
    (out / "kold_stamp.cu").write_text(
        stamp(oc.replace("namespace hisparse {", "namespace hisparse_old {"), "g_stamp")
    )
    nc = (
        (ROOT / "csrc/cuda/kernels.cu")
        .read_text()
        .replace('#include "kernels.cuh"', '#include "cuda/kernels.cuh"')
    )
    (out / "knew_stamp.cu").write_text(stamp(nc, "g_stamp2"))
    exe = out / "resolve_stages"
    templated = ["-DBASE_TEMPLATED"] if "bool FUSED, bool SMEM" in oc else []
    subprocess.run(
        [
            "nvcc",
            *templated,
            "-O3",
            "-std=c++17",
            "-arch=sm_90",
            "-lineinfo",
            f"-I{ROOT / 'csrc'}",
            f"-I{out}",
            str(HERE / "main.cu"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    return subprocess.run([str(exe), "100"]).returncode


if __name__ == "__main__":
    sys.exit(main())
