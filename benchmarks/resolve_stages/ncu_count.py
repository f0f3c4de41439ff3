"""Instructions per warp of each resolve stage, from an ncu source page of the stage harness.

    PROF=64 DUPS=0 ncu --kernel-name-base mangled -k regex:resolve_kernelILi1024ELb1 -c 6 \\
        --section SourceCounters -o b64 benchmarks/resolve_stages/build/resolve_stages 3
    ncu -i b64.ncu-rep --page source --csv --print-source sass > b64.csv
    python3 benchmarks/resolve_stages/ncu_count.py b64.csv 2048

The harness stamps the stage boundaries with clock reads (make.py), so the SASS between two
clock reads, in address order, is one stage (the compiler may place a rare path elsewhere).
Prints, per profiled kernel, executed instructions divided by the warps of the launch (the
second argument: CTAs x warps per CTA): stage 0 (the prologue and staging), the hash inserts,
and the rest of the row. With PROF=64 the first launch of each kernel starts from an empty
state (every key misses); the later ones are the steady state."""

import csv
import sys

STAGES = ("entry", "stage 0", "hash", "(marker)", "rest", "tail")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    warps = int(sys.argv[2])
    kernels = []
    for row in csv.reader(open(sys.argv[1])):
        if row and row[0] == "Kernel Name":
            kernels.append({"name": row[1], "rows": []})
        elif row and row[0] == "Address":
            kernels[-1]["header"] = {h: j for j, h in enumerate(row)}
        elif row and kernels:
            kernels[-1]["rows"].append(row)
    for k in kernels[::2]:  # ncu lists every profiled kernel twice on the source page
        col = k["header"]
        stage, per = 0, [0] * len(STAGES)
        for row in k["rows"]:
            if "SR_CLOCKLO" in row[col["Source"]]:
                stage = min(stage + 1, len(STAGES) - 1)
            per[stage] += int(row[col["Instructions Executed"]] or 0)
        parts = ", ".join(f"{n} {v / warps:.0f}" for n, v in zip(STAGES, per) if v)
        print(f"{k['name'][:60]}: {sum(per) / warps:.0f} per warp ({parts})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
