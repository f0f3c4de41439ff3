"""Per-layer decode cost of the DSA attention core the vLLM classes and the DSA engine run
(``hisparse.models.dsa.core``), on a GPU, at DeepSeek-V3.2's attention shapes: 128 heads,
kv_lora 512 + rope 64 in 656-byte FP8 rows, indexer 64 x 128 over 132-byte FP8 keys, top-k 2048.

One layer step, captured as a CUDA graph and replayed, in two modes over the same bytes:

* ``resident``: the indexer and its top-k over the paged key cache, then attention over the
  selected rows read by slot from the device row store;
* ``hisparse``: the same indexer, then the connector's runtime resolves the selection against
  each request's hot buffer (``hot_size`` rows), gathers the misses from the pinned host pool on
  the copy stream, and attention reads the hot rows.

The rows attention reads are a staged selection (``Drift``: about ``--miss`` of each request's
top-k is new each step), so the hit rate is fixed by the run, not by random weights; the
indexer's own ranking is computed every step all the same. Outputs of both modes are compared
bit for bit each round. Modes are interleaved, ``--rounds`` rounds of ``--steps`` replays.

    python benchmarks/bench_dsa_core.py --out benchmarks/results/dsa_core_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hisparse.engine.graph.replay import Drift
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore, TokenBatch
from hisparse.models.rows import KV_DIM, ROW_LAYOUTS, encode_rows
from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime

ROW = ROW_LAYOUTS["fp8"].row_bytes
BLOCK = 64
DSV32 = dict(
    model_type="deepseek_v32",
    num_hidden_layers=1,
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    index_topk=2048,
    index_n_heads=64,
    index_head_dim=128,
    max_position_embeddings=163840,
    rope_theta=10000.0,
)


class Layer:
    """One layer's static inputs and stores for ``batch`` requests of ``ctx`` tokens."""

    def __init__(self, core: SparseMLACore, batch: int, ctx: int, hot: int, seed: int):
        cfg, dev = core.cfg, torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(seed)
        self.core, self.batch = core, batch
        n = batch * ctx
        self.cache = core.key_cache(n // BLOCK, BLOCK, dev)
        self.store = torch.empty(n, ROW, dtype=torch.uint8, device=dev)
        self.host = torch.empty(n, ROW, dtype=torch.uint8, pin_memory=True)
        for s in range(0, n, 1 << 18):  # a quarter million rows at a time
            e = min(n, s + (1 << 18))
            k = torch.randn(e - s, cfg.index_head_dim, device=dev, generator=g)
            core.store_keys(self.cache, torch.arange(s, e, device=dev), k, BLOCK)
            self.store[s:e] = encode_rows(
                torch.randn(e - s, KV_DIM, device=dev, generator=g), "fp8"
            )
        self.host.copy_(self.store)
        blocks = ctx // BLOCK
        bt = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
        self.tokens = TokenBatch(
            torch.full((batch,), ctx - 1, device=dev),
            torch.arange(batch, device=dev),
            torch.full((batch,), ctx, device=dev),
            bt,
            BLOCK,
        )
        H, Hi, D = cfg.num_heads, cfg.index_n_heads, cfg.index_head_dim
        bf = torch.bfloat16
        self.q = torch.randn(batch, Hi, D, device=dev, generator=g).to(bf)
        self.w = torch.randn(batch, Hi, device=dev, generator=g)
        self.q_nope = torch.randn(batch, H, cfg.qk_nope_head_dim, device=dev, generator=g).to(bf)
        self.q_pe = torch.randn(batch, H, 64, device=dev, generator=g).to(bf)
        kv_b = torch.randn(
            H * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512, device=dev, generator=g
        )
        self.kv_b = (kv_b * 512**-0.5).to(bf)
        self.sel = torch.zeros(batch, cfg.index_topk, dtype=torch.int64, device=dev)
        self.hot = torch.zeros(batch * hot, ROW, dtype=torch.uint8, device=dev)
        self.group = HiSparseIndexGroup(
            f"bench{seed}", num_state_rows=batch, hot_size=hot, top_k=cfg.index_topk,
            max_batch=batch, num_keys=n, device=dev,
        )  # fmt: skip
        self.rt = HiSparseRuntime(f"layer{seed}", self.group, self.host, self.hot)
        self.state_rows = torch.arange(batch, dtype=torch.int32, device=dev)

    def step(self, mode: str) -> torch.Tensor:
        core = self.core
        ranked = core.select(self.q, self.w, self.cache, self.tokens)
        keys = self.tokens.slots(self.sel)
        if mode == "resident":
            out = core.attend(self.q_nope, self.q_pe, self.kv_b, self.store, keys)
        else:
            ids = self.rt.resolve(keys.to(torch.int32), self.state_rows)
            self.rt.gather()
            self.rt.wait_ready()
            out = core.attend(self.q_nope, self.q_pe, self.kv_b, self.hot, ids)
        return out + 0 * ranked[:, :1]  # the ranking is part of the step


def run_batch(args, batch: int) -> dict:
    cfg = DSAConfig.from_hf(DSV32)
    core = SparseMLACore(cfg, "fp8", "cuda", attention=args.attention)
    assert core.kernel_rows and core.kernel_index, "the Triton kernels must run here"
    layers = [Layer(core, batch, args.context, args.hot_size, s) for s in range(args.layers)]
    drift = Drift(batch, args.context, cfg.index_topk, args.miss, "cuda", seed=batch)

    def stage():
        drift.advance()
        sel = torch.topk(drift.bias, cfg.index_topk, dim=1).indices.sort(dim=1).values
        for lay in layers:
            lay.sel.copy_(sel)

    outs, graphs = {}, {}
    for mode in args.modes:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                stage()
                [lay.step(mode) for lay in layers]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[mode] = [lay.step(mode) for lay in layers]
        graphs[mode] = graph
    times = {m: [] for m in args.modes}
    identical, hits0 = True, [lay.group.counters[:2].clone() for lay in layers]
    for _ in range(args.rounds):
        for mode in args.modes:
            ms = []
            for _ in range(args.steps):
                stage()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graphs[mode].replay()
                b.record()
                ms.append((a, b))
            torch.cuda.synchronize()
            times[mode].append(statistics.median(x.elapsed_time(y) for x, y in ms))
        if len(args.modes) == 2:  # the last replay of each mode saw the same selection
            stage_same = [lay.sel.clone() for lay in layers]
            for m in args.modes:
                for lay, s in zip(layers, stage_same):
                    lay.sel.copy_(s)
                graphs[m].replay()
            torch.cuda.synchronize()
            identical &= all(torch.equal(x, y) for x, y in zip(*(outs[m] for m in args.modes)))
    hm = sum((lay.group.counters[:2] - h).view(torch.int64) for lay, h in zip(layers, hits0))
    hits, misses = (int(v) for v in hm.tolist())
    row = {"batch": batch, "layers": args.layers, "bit_identical": identical}
    for m in args.modes:
        per_layer = [1000 * t / args.layers for t in times[m]]
        row[f"{m}_us_per_layer"] = round(statistics.median(per_layer), 1)
        row[f"{m}_spread_us"] = [round(min(per_layer), 1), round(max(per_layer), 1)]
    if len(args.modes) == 2:
        row["ratio"] = round(row["hisparse_us_per_layer"] / row["resident_us_per_layer"], 3)
        row["hit_rate"] = round(hits / max(1, hits + misses), 4)
    layers.clear()
    graphs.clear()
    outs.clear()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batches", default="1,16,30,64")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hot-size", type=int, default=4096)
    p.add_argument("--miss", type=float, default=0.05, help="new share of the top-k per step")
    p.add_argument("--attention", choices=("bmm", "fused"), default="bmm")
    p.add_argument("--modes", default="resident,hisparse")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    if not torch.cuda.is_available():
        print("bench_dsa_core needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        t0 = time.time()
        rows.append(run_batch(args, b))
        print(json.dumps(rows[-1]), f"({time.time() - t0:.0f} s)", flush=True)
    result = {
        "core": "hisparse.models.dsa.core",
        "device": torch.cuda.get_device_name(),
        "context": args.context,
        "attention": args.attention,
        "miss": args.miss,
        "hot_size": args.hot_size,
        "rounds": args.rounds,
        "steps": args.steps,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
