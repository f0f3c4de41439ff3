"""Per-warp timeline of one resolve row: when each warp of block 0 passes each step of its row.

    python3 benchmarks/resolve_stages/make.py BASE_REV   # writes build/ (kernels, stamps)
    python3 benchmarks/resolve_stages/warps.py
    PROF=64 DUPS=0 benchmarks/resolve_stages/build/warps/rs 200

Builds a variant of the stage harness (main.cu) whose current kernel records, for lane 0 of
every warp of block 0, clock64 at the steps of its first row (the list in STEPS). For each timed
configuration it prints, per step, the medians over the timed calls of the earliest, the median
and the latest warp, in cycles after the earliest warp started the row. A step a warp does not
reach (a rare path) reads as -1. PROF=1 / 64 / 256 picks one workload, as in main.cu."""

from blocks import BUILD, HERE, build_variant, patched

# (name, anchor line in the current kernel, stamp before (False) or after (True) the anchor)
STEPS = [
    ("row start", "    const int s = a.state_rows[r];\n", False),
    ("hash cleared", "    const bool in_range = s >= 0 && s < a.S;\n", False),
    ("state row index in", "    if (SMEM) cp_async_wait_but_newest();  // the keys", False),
    ("at barrier: live", "    const bool live = in_range && !__syncthreads_or(dup);\n", False),
    ("barrier: live", "    const bool live = in_range && !__syncthreads_or(dup);\n", True),
    ("keys inserted", "    if (SMEM) cp_async_wait_all();\n    if (__syncthreads_or(rep", False),
    ("state row in", "    if (__syncthreads_or(repeated)) {\n      for (int i = tid;", False),
    ("barrier: hashed", "    // 2. Hits: each path", False),
    ("positions flagged", "  __syncthreads();  // the claims are in\n", False),
    ("barrier: claims", "  __syncthreads();  // the claims are in\n", True),
    ("keys ranked", "  if ((rk.tot.x >> 16) != (rk.tot.y >> 16)) {\n", False),
    ("order written", "  __syncthreads();  // the taken slots are listed\n", False),
    ("barrier: listed", "  __syncthreads();  // the taken slots are listed\n", True),
    ("misses assigned", "  if (any_pending) {\n", False),
    ("row done", "    if (tid == 0) {\n      a.miss_count[r] = static_cast<int>(counts.y);", False),
]
NS = len(STEPS)
DECL = f"__device__ long long g_w[{NS}][32];\n"


def stamp_line(k: int, in_kernel: bool) -> str:
    # the fused finishing function has no STAMP parameter: only the stamped kernel calls it here
    cond = "STAMP && " if in_kernel else ""
    return (
        f"  if ({cond}blockIdx.x == 0 && (threadIdx.x & 31) == 0) "
        f"g_w[{k}][threadIdx.x >> 5] = clock64();\n"
    )


COLLECT_AT = "        for (int k = 1; k <= 4; ++k) stg[k].push_back(hs[k] - hs[k - 1]);"
COLLECT = f"""
        if (c.stamp2) {{
          static long long gw[{NS}][32];
          CK(cudaMemcpyFromSymbol(gw, g_w, sizeof(gw)));
          const int nw = c.nt / 32;
          long long t0 = gw[0][0];
          for (int v = 0; v < nw; ++v) t0 = std::min(t0, gw[0][v]);
          for (int s = 0; s < {NS}; ++s) {{
            std::vector<long long> v;
            for (int q = 0; q < nw; ++q) if (gw[s][q] != -1) v.push_back(gw[s][q] - t0);
            std::sort(v.begin(), v.end());
            if (v.empty()) v.push_back(-1);
            wk[s][0].push_back(v.front()); wk[s][1].push_back(v[v.size() / 2]);
            wk[s][2].push_back(v.back());
          }}
          CK(cudaMemset(g_w_ptr, 0xFF, sizeof(gw)));
        }}"""
DECL_AT = "      std::vector<float> t; std::vector<long long> stg[5];"
PRINT_AT = "             m(1), m(2), m(3), m(4));"
NAMES = ", ".join(f'"{n}"' for n, _, _ in STEPS)
PRINT = f"""
      if (c.stamp2) {{
        static const char* names[] = {{{NAMES}}};
        printf("      %-20s %8s %8s %8s  (cycles after the first warp's row start)\\n",
               "step", "first", "median", "last");
        for (int s = 0; s < {NS}; ++s) {{
          long long q[3];
          for (int j = 0; j < 3; ++j) {{
            auto v = wk[s][j]; std::sort(v.begin(), v.end()); q[j] = v[v.size() / 2];
          }}
          printf("      %-20s %8lld %8lld %8lld\\n", names[s], q[0], q[1], q[2]);
        }}
      }}"""
SETUP_AT = "  char* flush; CK(cudaMalloc(&flush, 256 << 20));"
SETUP = (
    "\n  void* g_w_ptr; CK(cudaGetSymbolAddress(&g_w_ptr, g_w));"
    " CK(cudaMemset(g_w_ptr, 0xFF, sizeof(long long) * 32 * " + str(NS) + "));"
)


def main() -> int:
    kernel = (BUILD / "knew_stamp.cu").read_text()
    for k, (_, anchor, after) in enumerate(STEPS):
        line = stamp_line(k, in_kernel=anchor.startswith("    "))
        kernel = patched(kernel, anchor, anchor + line if after else line + anchor)
    kernel = DECL + kernel
    main_cu = (HERE / "main.cu").read_text()
    main_cu = patched(main_cu, COLLECT_AT, COLLECT_AT + COLLECT)
    main_cu = patched(main_cu, DECL_AT, DECL_AT + f" std::vector<long long> wk[{NS}][3];")
    main_cu = patched(main_cu, PRINT_AT, PRINT_AT + PRINT)
    main_cu = patched(main_cu, SETUP_AT, SETUP_AT + SETUP)
    build_variant("warps", kernel, main_cu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
