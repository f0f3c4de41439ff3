"""Per-CTA timing of the resolve kernel: where batch 64 spends the time batch 1 does not.

    python3 benchmarks/resolve_stages/make.py BASE_REV     # writes build/ (kernels, stamps)
    python3 benchmarks/resolve_stages/blocks.py [--no-stats]
    PROF=64 DUPS=0 benchmarks/resolve_stages/build/blocks/rs 200

Builds a variant of the stage harness (main.cu) whose current kernel also records, per CTA, its
start and end (%globaltimer, ns) and its row's cycles (clock64 on its own SM). For each timed
configuration it prints the medians over the timed calls of: the spread of the CTAs' start
times, first start to last end, and the median and the maximum row cycles over the CTAs.
--no-stats drops the kernel's two stats atomics (to see whether 64 CTAs contending on one
counter cost anything). PROF=1 / 64 / 256 picks one workload, as in main.cu."""

import argparse
import pathlib
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BUILD = HERE / "build"

TIMERS = (
    "__device__ __forceinline__ long long gtime() {\n"
    '  long long t;\n  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));\n  return t;\n}\n'
    "__device__ long long g_blk[4][256];\n"
)
START = "  if (STAMP && blockIdx.x == 0 && tid == 0) g_stamp2[0] = clock64();\n"
START_ADD = (
    "  if (STAMP && tid == 0) {\n"
    "    g_blk[0][blockIdx.x] = gtime();\n    g_blk[1][blockIdx.x] = clock64();\n  }\n"
)
END = "    if (STAMP && blockIdx.x == 0 && tid == 0 && r == 0) g_stamp2[4] = clock64();\n"
END_ADD = (
    "    if (STAMP && tid == 0 && r == blockIdx.x) {\n"
    "      g_blk[3][blockIdx.x] = clock64();\n      g_blk[2][blockIdx.x] = gtime();\n    }\n"
)
STATS = (
    "      atomicAdd(&a.stats[0], static_cast<unsigned long long>(counts.x));\n"
    "      atomicAdd(&a.stats[1], static_cast<unsigned long long>(counts.y));\n"
)
# main.cu: collect the per-CTA records after each timed call of the current kernel, print them
COLLECT_AT = "        for (int k = 1; k <= 4; ++k) stg[k].push_back(hs[k] - hs[k - 1]);"
COLLECT = """
        if (c.stamp2) {
          static long long gb[4][256];
          CK(cudaMemcpyFromSymbol(gb, g_blk, sizeof(gb)));
          long long s0 = gb[0][0], s1 = gb[0][0], e1 = gb[2][0];
          std::vector<long long> cyc;
          for (int b = 0; b < B; ++b) {
            s0 = std::min(s0, gb[0][b]); s1 = std::max(s1, gb[0][b]); e1 = std::max(e1, gb[2][b]);
            cyc.push_back(gb[3][b] - gb[1][b]);
          }
          std::sort(cyc.begin(), cyc.end());
          bk[0].push_back(s1 - s0); bk[1].push_back(e1 - s0);
          bk[2].push_back(cyc[B / 2]); bk[3].push_back(cyc[B - 1]);
        }"""
DECL_AT = "      std::vector<float> t; std::vector<long long> stg[5];"
PRINT_AT = "             m(1), m(2), m(3), m(4));"
PRINT = """
      if (c.stamp2) {
        auto q = [&](int k) {
          auto v = bk[k]; std::sort(v.begin(), v.end()); return v[v.size() / 2];
        };
        printf("      CTAs: start spread %lld ns, first start to last end %lld ns, "
               "row cycles median %lld max %lld\\n", q(0), q(1), q(2), q(3));
      }"""


def patched(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"expected one {old.strip()[:60]!r}; rerun make.py with a current tree")
    return text.replace(old, new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-stats", action="store_true", help="drop the two stats atomics")
    args = ap.parse_args()
    kernel = (BUILD / "knew_stamp.cu").read_text()
    kernel = patched(kernel, START, START + START_ADD)
    kernel = TIMERS + patched(kernel, END, END + END_ADD)
    if args.no_stats:
        kernel = patched(kernel, STATS, "")
    main_cu = (HERE / "main.cu").read_text()
    main_cu = patched(main_cu, COLLECT_AT, COLLECT_AT + COLLECT)
    main_cu = patched(main_cu, DECL_AT, DECL_AT + " std::vector<long long> bk[4];")
    main_cu = patched(main_cu, PRINT_AT, PRINT_AT + PRINT)
    build_variant("blocks", kernel, main_cu)
    return 0


def build_variant(name: str, kernel: str, main_cu: str) -> None:
    """Compiles a patched current kernel and harness into build/NAME/rs (make.py's baseline)."""
    out = BUILD / name
    out.mkdir(exist_ok=True)
    (out / "knew_stamp.cu").write_text(kernel)
    (out / "main.cu").write_text(main_cu)
    base = (BUILD / "kold_stamp.cu").read_text()
    templated = ["-DBASE_TEMPLATED"] if "bool FUSED, bool SMEM" in base else []
    cmd = ["nvcc", *templated, "-O3", "-std=c++17", "-arch=sm_90", "-lineinfo"]
    cmd += [f"-I{ROOT / 'csrc'}", f"-I{out}", f"-I{BUILD}", str(out / "main.cu")]
    cmd += ["-o", str(out / "rs")]
    subprocess.run(cmd, check=True)
    print(f"built {out / 'rs'}")


if __name__ == "__main__":
    raise SystemExit(main())
