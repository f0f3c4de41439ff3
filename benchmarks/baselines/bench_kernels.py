"""The decode step's kernels one by one, beside the field's baselines on the same GPU and the same
input bytes, with achieved TFLOP/s or GB/s against the H200's limits:

* ``mla``: sparse MLA decode, 128 heads over 2048 selected 656-byte FP8 rows per request (one
  query token) -- the core's batched-products path ("bmm") and fused kernel ("fused") against
  FlashMLA's sparse FP8 decode (its layout is the project's fp8 row byte for byte);
* ``indexer``: the DSA indexer's scores, 64 heads x 128 over 132-byte FP8 keys, one query token
  per request -- the core's paged Triton kernel against DeepGEMM's paged decode kernel
  (``fp8_paged_mqa_logits``, which reads the project's key cache as it is: vLLM's layout) and
  its non-paged one (``fp8_mqa_logits``, over the same keys laid out contiguously);
* ``topk``: 2048 of each request's scores as the core takes them (``torch.topk`` unsorted, then
  one launch sorting the positions in registers and writing their slots), against the HBM
  roofline of one read of the scores (no baseline kernel is built);
* ``resolve``: ``hisparse::resolve_residency`` on a drifting trace (5 % of each top-k new per
  step), bytes of every tensor it reads or writes.

Method: inputs built once per shape; every output checked against a float64 reference over the
same decoded bytes (and ours against the baseline's) before timing; each call timed alone by
CUDA events after a write of 256 MB (L2 holds none of its inputs), median of ``--reps`` calls;
``--repeats`` such medians, ours and the baseline's interleaved, reported as their median and
min-max. Baselines are imported where built (``build_flashmla.sh``, ``build_deepgemm.sh``); a
missing one is recorded with the reason.

    PYTHONPATH=$PWD:$PWD/benchmarks/baselines/src/flashmla:$PWD/benchmarks/baselines/src/deepgemm \
        python benchmarks/baselines/bench_kernels.py \
        --json benchmarks/results/kernels_vs_baselines_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

# The H200's limits (vendor datasheet, SXM, dense): what "of peak" is taken against.
PEAK = {"hbm_gbs": 4800.0, "bf16_tflops": 989.0, "fp8_tflops": 1979.0}
FLASHMLA_COMMIT = "9241ae3"
DEEPGEMM_COMMIT = "54e2261"
HEADS, TOP_K, ROW, BLOCK = 128, 2048, 656, 64
IDX_HEADS, IDX_DIM = 64, 128
KEY = IDX_DIM + 4
TOL = 0.02  # max |got - want| / max |want|: FP8 inputs, bf16 / fp32 arithmetic
PARTS = ("mla", "indexer", "topk", "resolve")


# ---------------------------------------------------------------------------- report (CPU-tested)
def rate(work: float, us: float | None, unit: str) -> float | None:
    """TFLOP/s (work in FLOP) or GB/s (work in bytes) of ``work`` done in ``us``."""
    if not us:
        return None
    return work / us / (1e6 if unit == "TFLOP/s" else 1e3)


def make_row(kernel: str, shape: str, unit: str, work: float, ours: dict, baseline: dict,
             peak: float, **extra) -> dict:  # fmt: skip
    """One kernel and shape: ``ours`` / ``baseline`` are {"impl", "us", "spread_us", "err"}
    (baseline also "commit", or "absent": the reason); rates, share of ``peak`` and ratio."""
    row = dict(kernel=kernel, shape=shape, unit=unit, work=work, peak=peak)
    row.update(
        ours_impl=ours["impl"], ours_us=ours["us"], ours_spread_us=ours.get("spread_us"),
        ours_err=ours.get("err"), ours_rate=rate(work, ours["us"], unit),
        ours_timing=ours.get("timing"),
    )  # fmt: skip
    b_us = baseline.get("us")
    row.update(
        baseline=baseline["impl"], baseline_commit=baseline.get("commit"),
        baseline_absent=baseline.get("absent"), baseline_us=b_us,
        baseline_spread_us=baseline.get("spread_us"), baseline_err=baseline.get("err"),
        baseline_rate=rate(work, b_us, unit), baseline_timing=baseline.get("timing"),
    )  # fmt: skip
    row["ours_of_peak"] = row["ours_rate"] / peak if row["ours_rate"] else None
    row["ours_vs_baseline"] = ours["us"] / b_us if b_us and ours["us"] else None
    row.update(extra)
    return row


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    out = [
        f"# The decode step's kernels beside the baselines ({res['device']})",
        "",
        f"`benchmarks/baselines/bench_kernels.py` at {res.get('commit', '?')}, torch "
        f"{res.get('torch', '?')}. {res['method']} Limits: HBM {PEAK['hbm_gbs']:.0f} GB/s, dense "
        f"bf16 {PEAK['bf16_tflops']:.0f} / FP8 {PEAK['fp8_tflops']:.0f} TFLOP/s (datasheet).",
        "",
        "| kernel | shape | ours | ours µs (min-max) | ours rate | of peak | baseline | "
        "baseline µs (min-max) | baseline rate | ours ÷ baseline time | checked |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|:---:|",
    ]
    for r in res["rows"]:
        spread = lambda s: f" ({s[0]:.1f}-{s[1]:.1f})" if s else ""  # noqa: E731
        if r["baseline_us"] is not None:
            base = f"{r['baseline']} @ {r['baseline_commit']}"
            b_us = f"{r['baseline_us']:.1f}{spread(r['baseline_spread_us'])}"
        else:
            base, b_us = f"{r['baseline']}: {r['baseline_absent']}", "-"
        unit = r["unit"]
        out.append(
            f"| {r['kernel']} | {r['shape']} | {r['ours_impl']} | "
            f"{r['ours_us']:.1f}{spread(r['ours_spread_us'])} | {_f(r['ours_rate'])} {unit} | "
            f"{_f(r['ours_of_peak'], '{:.0%}')} | {base} | {b_us} | "
            f"{_f(r['baseline_rate'])}{' ' + unit if r['baseline_rate'] else ''} | "
            f"{_f(r['ours_vs_baseline'], '{:.2f}x')} | {'yes' if r.get('checked') else 'no'} |"
        )
    for note in res.get("notes", []):
        out += ["", note]
    if res.get("kernel_split"):
        out += split_markdown(res["kernel_split"])
    return "\n".join(out) + "\n"


def split_markdown(split: dict) -> list:
    """bench_decode_tpot.py --kernel-split's result as a table: kernel time per layer by
    category per mode and batch, and each category's slope per request and layer."""
    ks, cfg = split["kernel_split"], split["config"]
    rows, (lo, hi) = ks["batches"], ks["between"]
    cols = [(m, r["batch"]) for m in ("resident", "hisparse") for r in rows]
    out = [
        "",
        f"## The captured decode step by kernel category, context {cfg['context']}",
        "",
        f"`bench_decode_tpot.py --kernel-split` ({cfg['layers']} layers, attention "
        f"{cfg['attention']}): GPU time per layer of each category's kernels over "
        f"{split['split_steps']} eager steps per mode (torch.profiler, each kernel under the core "
        "call that launched it), the captured step's time per layer (CUDA graph, median of "
        f"{split['rounds']} rounds x {split['steps']} replays), and the slope per request and "
        f"layer between batches {lo} and {hi}. 'rest': projections, norms, MLP and the LM head "
        "spread over the layers; the save runs on the copy stream, beside the rest.",
        "",
        "| category | "
        + " | ".join(f"{m} b{b} µs" for m, b in cols)
        + " | resident slope µs | HiSparse slope µs |",
        "|---|" + "---:|" * (len(cols) + 2),
    ]
    per = {(r["batch"], m): r["per_layer"][m] for r in rows for m in ("resident", "hisparse")}
    slope = ks.get("per_request_layer_us", {})
    cats = [*per[(lo, "resident")]["per_layer_us"], "graph"]
    for c in cats:
        name = {"total": "kernels, total", "graph": "captured step per layer"}.get(c, c)
        vals = [
            per[(b, m)]["graph_us"] if c == "graph" else per[(b, m)]["per_layer_us"][c]
            for m, b in cols
        ]
        sl = [slope.get(m, {}).get(c) for m in ("resident", "hisparse")]
        out.append(
            f"| {name} | "
            + " | ".join(f"{v:.1f}" for v in vals)
            + " | "
            + " | ".join(_f(v, "{:.3f}") for v in sl)
            + " |"
        )
    return out


def write(res: dict, json_path: str | None, md_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    if md_path:
        Path(md_path).write_text(markdown(res))


# ---------------------------------------------------------------------------- timing
class Timer:
    """Each call alone: a 256 MB write first (L2 holds none of its inputs), then CUDA events
    around the call; the median of ``reps`` queued calls."""

    def __init__(self, reps: int, repeats: int) -> None:
        self.reps, self.repeats = reps, repeats
        self.flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")

    def once(self, fn, pre=None) -> float:
        fn()
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(self.reps)]
        for a, b in ev:
            if pre is not None:  # untimed: the next call's inputs
                pre()
            self.flush.zero_()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)

    def compare(self, fns: dict, pre=None) -> dict:
        """{name: (median us, [min, max])} over ``repeats`` medians, the names interleaved; each
        call a CUDA graph replay where it captures (no host launch time inside the timing,
        as in the captured decode step), else eager (``self.how`` says which)."""
        run = {k: self.graph(fn) or fn for k, fn in fns.items()}
        self.how = {k: "eager" if run[k] is fns[k] else "graph" for k in fns}
        got = {k: [] for k in fns}
        for _ in range(self.repeats):
            for k, fn in run.items():
                got[k].append(self.once(fn, pre))
        med = {k: (statistics.median(v), [min(v), max(v)]) for k, v in got.items()}
        return Times(med, self.how)

    @staticmethod
    def graph(fn):
        """``fn`` captured as a CUDA graph (after warm calls on a side stream): its replay."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            return g.replay
        except Exception as e:  # noqa: BLE001 (timed eagerly then, and said so)
            print(f"graph capture failed, timed eagerly: {type(e).__name__}: {e}", flush=True)
            torch.cuda.synchronize()
            return None


def err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    ok = torch.isfinite(want)
    return float((got[ok] - want[ok]).abs().max() / want[ok].abs().max())


def _timed(t: dict, name: str, impl: str, e: float | None, **kw) -> dict:
    us, spread = t[name]
    return dict(impl=impl, us=us, spread_us=spread, err=e, timing=t.how.get(name), **kw)


class Times(dict):
    """Timer.compare's result with how each was timed (graph replay or eager)."""

    def __init__(self, got: dict, how: dict) -> None:
        super().__init__(got)
        self.how = how


# ---------------------------------------------------------------------------- baselines
def flashmla():
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception as e:  # noqa: BLE001 (any import failure is the reason recorded)
        return None, f"not importable ({type(e).__name__}: {e})"
    return (flash_mla_with_kvcache, get_mla_metadata), None


def deepgemm():
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001
        return None, f"not importable ({type(e).__name__}: {e})"
    if not hasattr(deep_gemm, "fp8_paged_mqa_logits"):
        return None, "built without its FP8 kernels (CUDA runtime too old for them)"
    return deep_gemm, None


# ---------------------------------------------------------------------------- kernels
def bench_mla(args, timer, g) -> list:
    from hisparse.engine.graph import GraphConfig
    from hisparse.models.dsa.core import SparseMLACore
    from hisparse.models.dsa.kernels.rows import gather_decode
    from hisparse.models.rows import encode_rows

    fm, why = flashmla()
    dsa = GraphConfig.deepseek_v32().dsa_config()
    cores = {a: SparseMLACore(dsa, "fp8", "cuda", attention=a) for a in ("bmm", "fused")}
    scale, R, rows = dsa.softmax_scale, args.mla_context, []
    for n in args.mla_batches:
        src = torch.empty(n * R, ROW, dtype=torch.uint8, device="cuda")
        for s in range(0, n * R, 1 << 18):
            e = min(n * R, s + (1 << 18))
            src[s:e] = encode_rows(torch.randn(e - s, 576, device="cuda", generator=g), "fp8")
        ids = torch.stack(
            [torch.randperm(R, generator=g, device="cuda")[:TOP_K].sort().values + b * R
             for b in range(n)]
        )  # fmt: skip
        q = (torch.randn(n, HEADS, 576, device="cuda", generator=g) * 0.5).bfloat16()
        kv = gather_decode(src, ids).double()  # the rows' exact values
        s = torch.einsum("nhd,nkd->nhk", q.double(), kv) * scale
        want = torch.einsum("nhk,nkd->nhd", s.softmax(-1), kv[..., :512])
        del kv, s
        fns = {a: (lambda c=c: c.attend_latent(q, src, ids)) for a, c in cores.items()}
        errs = {a: err(fn(), want) for a, fn in fns.items()}
        if fm is not None:
            try:
                flash, metadata = fm
                meta, _ = metadata()
                kv4, ids3 = src.view(-1, BLOCK, 1, ROW), ids.view(n, 1, TOP_K).to(torch.int32)
                fns["flashmla"] = lambda: flash(
                    q.view(n, 1, HEADS, 576), kv4, None, None, 512, meta, softmax_scale=scale,
                    is_fp8_kvcache=True, indices=ids3,
                )[0]  # fmt: skip
                theirs = fns["flashmla"]().view(n, HEADS, 512)
                errs["flashmla"] = err(theirs, want)
                errs["ours_vs_flashmla"] = err(fns["bmm"](), theirs.double())
            except Exception as e:  # noqa: BLE001 (recorded as the reason)
                fm, why = None, f"failed: {type(e).__name__}: {e}"
                fns.pop("flashmla", None)
        t = timer.compare(fns)
        best = min(("bmm", "fused"), key=lambda a: t[a][0])
        ours = _timed(t, best, f"{best} (bmm: {t['bmm'][0]:.1f}, fused: {t['fused'][0]:.1f} µs)",
                      errs[best])  # fmt: skip
        base = (
            _timed(t, "flashmla", "FlashMLA sparse FP8 decode", errs["flashmla"],
                   commit=FLASHMLA_COMMIT)
            if fm is not None else dict(impl="FlashMLA sparse FP8 decode", absent=why)
        )  # fmt: skip
        flop = 2.0 * n * HEADS * TOP_K * (576 + 512)
        checked = all(v < TOL for k, v in errs.items() if k != "ours_vs_flashmla")
        rows.append(make_row(
            "sparse MLA decode", f"batch {n}, 128 heads, top-k 2048 of {R}", "TFLOP/s", flop,
            ours, base, PEAK["bf16_tflops"], batch=n, errors=errs, checked=checked,
            bmm_us=t["bmm"][0], fused_us=t["fused"][0],
            bytes_read=n * TOP_K * ROW,
        ))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        src = fns = None  # freed before the next batch's rows
        torch.cuda.empty_cache()
    return rows


def _index_inputs(B: int, L: int, g):
    from hisparse.models.dsa.kernels import indexer as idx

    blocks = B * L // BLOCK
    cache = torch.empty(blocks, BLOCK * KEY, dtype=torch.uint8, device="cuda")
    for s in range(0, B * L, 1 << 20):
        e = min(B * L, s + (1 << 20))
        k = torch.randn(e - s, IDX_DIM, device="cuda", generator=g)
        idx.store_fp8_keys(cache, torch.arange(s, e, device="cuda"), k, BLOCK)
    q = torch.randn(B, IDX_HEADS, IDX_DIM, device="cuda", generator=g).bfloat16()
    # the core's scaling of the head weights (H^-1/2 D^-1/2), both kernels get the same
    hw = torch.randn(B, IDX_HEADS, device="cuda", generator=g) * (IDX_HEADS * IDX_DIM) ** -0.5
    bt = torch.arange(blocks, device="cuda", dtype=torch.int32).view(B, L // BLOCK)
    return cache, q, hw, bt


def _index_reference(cache, q, hw, b: int, L: int) -> torch.Tensor:
    """float64 scores of request ``b`` (its L keys, blocks b*L/64 on) for queries q [Hi, D]."""
    blk = cache.view(-1, BLOCK, KEY)[b * L // BLOCK : (b + 1) * L // BLOCK]
    vals = blk.reshape(-1, BLOCK * KEY)[:, : BLOCK * IDX_DIM].reshape(-1, IDX_DIM)
    k = vals.contiguous().view(torch.float8_e4m3fn).double()
    sc = blk.reshape(-1, BLOCK * KEY)[:, BLOCK * IDX_DIM :].contiguous().view(torch.float32)
    k = k * sc.reshape(-1, 1).double()
    return (torch.relu(q.double() @ k.T) * hw.double()[:, None]).sum(0)


def bench_indexer(args, timer, g, keep_scores: dict) -> list:
    from hisparse.models.dsa.kernels import indexer as idx

    dg, why = deepgemm()
    rows = []
    for L in args.index_contexts:
        for B in args.index_batches:
            cache, q, hw, bt = _index_inputs(B, L, g)
            req = torch.arange(B, device="cuda")
            pos = torch.full((B,), L - 1, device="cuda")
            fns = {"ours": lambda: idx.paged_scores(q, hw, cache, bt, BLOCK, req, pos)}
            out = {"ours": fns["ours"]()}
            check = sorted({0, B - 1})
            want = {b: _index_reference(cache, q[b], hw[b], b, L) for b in check}
            errs = {"ours": max(err(out["ours"][b], want[b]) for b in check)}
            if dg is not None:
                try:
                    q8 = q.float().to(torch.float8_e4m3fn).contiguous()
                    w = hw.float().contiguous()
                    kv = cache.view(-1, BLOCK, 1, KEY)
                    lens = torch.full((B, 1), L, dtype=torch.int32, device="cuda")
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    meta = dg.get_paged_mqa_logits_metadata(lens, BLOCK, sms)
                    q4 = q8.view(B, 1, IDX_HEADS, IDX_DIM)
                    fns["paged"] = lambda: dg.fp8_paged_mqa_logits(
                        q4, kv, w, lens, bt, meta, L, False
                    )
                    flat = cache.view(-1, BLOCK * KEY)
                    keys = flat[:, : BLOCK * IDX_DIM].reshape(-1, IDX_DIM).view(torch.float8_e4m3fn)
                    scales = flat[:, BLOCK * IDX_DIM :].contiguous().view(torch.float32).reshape(-1)
                    ks = (torch.arange(B, device="cuda", dtype=torch.int32) * L).contiguous()
                    ke = (ks + L).contiguous()
                    fns["flat"] = lambda: dg.fp8_mqa_logits(q8, (keys, scales), w, ks, ke, False, L)
                    want8 = {b: _index_reference(cache, q8[b].float(), hw[b], b, L) for b in check}
                    for k in ("paged", "flat"):
                        out[k] = fns[k]()
                        errs[k] = max(err(out[k][b, :L], want8[b]) for b in check)
                    errs["ours_vs_paged"] = max(
                        err(out["ours"][b], out["paged"][b, :L]) for b in check
                    )
                except Exception as e:  # noqa: BLE001 (recorded as the reason)
                    dg, why = None, f"failed: {type(e).__name__}: {e}"
                    for k in ("paged", "flat"):
                        fns.pop(k, None)
            keep_scores[(B, L)] = out["ours"]
            t = timer.compare(fns)
            ours = _timed(t, "ours", "paged Triton kernel", errs["ours"])
            flop, nbytes = 2.0 * B * IDX_HEADS * IDX_DIM * L, float(B * L * KEY)
            checked = all(v < TOL for k, v in errs.items() if not k.startswith("ours_vs"))
            for k, name in (("paged", "DeepGEMM fp8_paged_mqa_logits"),
                            ("flat", "DeepGEMM fp8_mqa_logits (non-paged)")):  # fmt: skip
                base = (
                    _timed(t, k, name, errs[k], commit=DEEPGEMM_COMMIT) if dg is not None
                    else dict(impl=name, absent=why)
                )  # fmt: skip
                rows.append(make_row(
                    "DSA indexer scores", f"batch {B} x {L} keys, 64 x 128", "GB/s", nbytes,
                    ours, base, PEAK["hbm_gbs"], batch=B, keys=L, flop=flop,
                    ours_tflops=rate(flop, ours["us"], "TFLOP/s"),
                    baseline_tflops=rate(flop, base.get("us"), "TFLOP/s"), errors=errs,
                    checked=checked,
                ))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            cache = fns = out = None
            torch.cuda.empty_cache()
    return rows


def bench_topk(args, timer, g, scores: dict) -> list:
    from hisparse import ops
    from hisparse.models.dsa.kernels import select

    rows = []
    for (B, L), sc in sorted(scores.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        req = torch.arange(B, device="cuda")
        bt = torch.arange(B * L // BLOCK, device="cuda", dtype=torch.int32).view(B, -1)
        out = torch.empty(B, TOP_K, dtype=torch.int64, device="cuda")

        def core(sc=sc, req=req, bt=bt, out=out):  # the core's select after the scores
            ops.topk_slots(sc, req, bt, BLOCK, out)
            return out

        def former(sc=sc, req=req, bt=bt):  # the core's select until the radix kernel
            best, i = sc.topk(TOP_K, dim=-1, sorted=False)
            return select.selection_slots(best, i, req, bt, BLOCK, TOP_K)

        want = sc.topk(TOP_K, dim=-1).indices.sort(-1).values + req[:, None] * L
        same = min(float((f() == want).float().mean()) for f in (core, former))
        t = timer.compare({"core": core, "former": former})
        nbytes = float(B * L * 4)
        roof = nbytes / PEAK["hbm_gbs"] / 1e3
        ours = _timed(t, "core", "hisparse_topk_slots (radix select, slots by position)", None)
        base = _timed(t, "former", "torch.topk + sorted slots in one launch (the former path)",
                      None, commit=args.commit)  # fmt: skip
        rows.append(make_row(
            "top-k 2048 + slots", f"batch {B} x {L} scores", "GB/s", nbytes, ours, base,
            PEAK["hbm_gbs"], batch=B, keys=L, roofline_us=roof, same_selection=same,
            checked=same == 1.0,
        ))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_resolve(args, timer) -> list:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_ops import ResolveSetup

    rows, rate_ = [], args.resolve_miss
    for B in args.resolve_batches:
        st = ResolveSetup(B, "cuda", seed=B)
        st.call()
        for _ in range(3):
            st.advance(rate_)
            st.call()

        t = timer.compare({"resolve": st.call}, pre=lambda st=st: st.advance(rate_))
        us, spread = t["resolve"]
        state = st.slot_keys[:B].nbytes + st.lru[:B].nbytes
        nbytes = float(st.top_k.nbytes + 2 * state + st.out.nbytes + st.src.nbytes
                       + st.dst.nbytes + st.cnt.nbytes)  # fmt: skip
        miss = float(st.cnt.sum()) / (B * TOP_K)  # the last call's new share
        ours = dict(impl="hisparse::resolve_residency", us=us, spread_us=spread, err=None)
        base = dict(impl="vLLM's resolve kernels", absent="not built in this run (an earlier "
                    "same-H200 comparison: docs/results.md, op micro-benchmarks)")  # fmt: skip
        rows.append(make_row(
            "resolve", f"batch {B}, hot 4096, top-k 2048, {rate_:.0%} new", "GB/s", nbytes,
            ours, base, PEAK["hbm_gbs"], batch=B, miss_rate=miss,
            checked=abs(miss - rate_) < 0.03,
        ))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _ints(s: str) -> list:
    return [int(x) for x in s.split(",") if x]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"among {','.join(PARTS)}")
    ap.add_argument("--mla-batches", default="1,16,64,128")
    ap.add_argument("--mla-context", type=int, default=32768, help="rows each request selects from")
    ap.add_argument("--index-contexts", default="32768,65536,131072")
    ap.add_argument("--index-batches", default="1,64")
    ap.add_argument("--resolve-batches", default="1,16,64,128")
    ap.add_argument("--resolve-miss", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=20, help="calls per median")
    ap.add_argument("--repeats", type=int, default=5, help="medians per figure")
    ap.add_argument("--commit", default="?", help="the tree's commit, for the report")
    ap.add_argument("--split", help="bench_decode_tpot.py --kernel-split's JSON, to include")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    try:
        args.parts = [p for p in args.parts.split(",") if p]
        bad = set(args.parts) - set(PARTS)
        if bad or not args.parts:
            raise ValueError(f"--parts must be among {PARTS}, got {sorted(bad) or 'none'}")
        for k in ("mla_batches", "index_contexts", "index_batches", "resolve_batches"):
            setattr(args, k, _ints(getattr(args, k)))
        if any(L % BLOCK or L < TOP_K for L in args.index_contexts):
            raise ValueError(f"--index-contexts must be multiples of {BLOCK}, >= {TOP_K}")
        if args.mla_context < TOP_K or args.reps < 1 or args.repeats < 1:
            raise ValueError(f"--mla-context must be >= {TOP_K}; --reps, --repeats >= 1")
        if not 0 <= args.resolve_miss <= 1:
            raise ValueError("--resolve-miss is a share, 0..1")
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    timer = Timer(args.reps, args.repeats)
    g = torch.Generator(device="cuda").manual_seed(0)
    res = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit,
        method="Each call alone after a 256 MB write (cold L2), CUDA events around its CUDA "
        "graph's replay (eager where a call does not capture: the row's timing field); median of "
        f"{args.reps} calls, {args.repeats} such medians interleaved with the baseline's: their "
        "median (min-max). Outputs checked against a float64 reference over the same bytes "
        f"(max error / max value < {TOL}) before timing.",
        peak=PEAK, rows=[], notes=[],
    )  # fmt: skip
    if args.split and Path(args.split).exists():
        res["kernel_split"] = json.loads(Path(args.split).read_text())
    scores: dict = {}
    parts = [("mla", lambda: bench_mla(args, timer, g))]
    if "indexer" in args.parts or "topk" in args.parts:  # the top-k ranks the indexer's scores
        parts.append(("indexer", lambda: bench_indexer(args, timer, g, scores)))
    parts += [("topk", lambda: bench_topk(args, timer, g, scores)),
              ("resolve", lambda: bench_resolve(args, timer))]  # fmt: skip
    for name, fn in parts:
        if name not in args.parts and not (name == "indexer" and "topk" in args.parts):
            continue
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 (the other parts still run; the reason is kept)
            res["notes"].append(f"{name}: failed ({type(e).__name__}: {e})")
            print(res["notes"][-1], file=sys.stderr, flush=True)
            continue
        res["rows"] += got if name in args.parts else []
        write(res, args.json, args.md)  # after each part: a later failure keeps these
    write(res, args.json, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
