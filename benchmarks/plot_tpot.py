"""Plot of engine_tpot_*.json (bench_decode_tpot.py): ms per output token and step ratio by batch.

python benchmarks/plot_tpot.py benchmarks/results/engine_tpot_h200.json
"""

from __future__ import annotations

import json
import sys

MODES = (("resident", "resident"), ("hisparse", "HiSparse"))


def main(argv=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = (argv or sys.argv[1:])[0]
    res = json.load(open(path))
    rows = res["batches"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    batch = [r["batch"] for r in rows]
    for (key, label), color in zip(MODES, ("C0", "C1")):
        per_token = [r[f"{key}_ms_per_step"] / r["batch"] for r in rows]
        a.plot(batch, per_token, "o-", color=color, label=label)
    b.plot(batch, [r["ratio"] for r in rows], "o-", color="C1", label="HiSparse / resident")
    cap = max(r["batch"] for r in rows if r["fits_resident_budget"])
    for ax in (a, b):
        ax.axvline(cap, color="grey", ls=":", label=f"resident fits {cap}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"batch (requests, {res['config']['context']} tokens each)")
    a.set_yscale("log")
    a.set_ylabel("ms per output token")
    b.axhline(1.10, color="red", ls="--", label="goal 1.10x")
    b.set_ylabel("step time / resident's (same round)")
    b.legend(fontsize=7)
    a.legend(fontsize=7)
    hit = rows[-1]["hit_rate"]
    fig.suptitle(
        f"{res['config']['layers']}-layer DeepSeek-V3.2-shaped decode step, CUDA graph, "
        f"{res['device']}, hit rate {hit:.3f}"
    )
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
