"""Decode step of the code the vLLM classes and the DSA engine run (``hisparse.models.dsa``: the
projections and the batched attention core), on a GPU, at DeepSeek-V3.2's shapes: hidden 7168,
q_lora 1536, 128 heads, kv_lora 512 + rope 64 in 656-byte FP8 rows, indexer 64 x 128 over
132-byte FP8 keys, top-k 2048. The MoE is stood in by a dense SwiGLU of its active width per
token (8 routed + 1 shared expert x 2048 = 18432), so each layer does the same matrix work per
token. Weights are random bf16.

Per layer: norms, the MLA and indexer projections with rotary, the new row and key stored, the
indexer's top-k (``core.select``), attention over the selected rows (``core.attend``), o_proj and
the MLP. Two modes over the same bytes:

* ``resident``: rows read by slot from the device row store;
* ``hisparse``: the new row saved to the pinned host pool on the copy stream (as the connector
  saves), the selection resolved against each request's hot buffer, misses gathered from the
  host pool, attention over the hot rows.

The rows attention reads are a staged selection (``Drift``: about ``--miss`` of each request's
top-k is new each step), so the hit rate is the run's setting, not random weights'; the indexer's
own ranking is computed every step all the same. A step of ``--layers`` layers is captured as one
CUDA graph and replayed; modes interleave, ``--rounds`` rounds of ``--steps`` replays; both
modes' outputs are compared bit for bit. ``--capacity`` adds each mode at the most requests a
45 GiB KV budget over DeepSeek-V3.2's 61 layers holds (``MemoryBudget``) and the tokens/s ratio.

    python benchmarks/bench_dsa_core.py --capacity --out benchmarks/results/dsa_core_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hisparse import ops
from hisparse.engine.graph.config import GraphConfig, MemoryBudget
from hisparse.engine.graph.replay import Drift
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore, TokenBatch
from hisparse.models.dsa.decoder import Rotary, rms_norm
from hisparse.models.dsa.projections import index_inputs, mla_inputs
from hisparse.models.rows import ROW_FORMATS, encode_rows
from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime

ROW = ROW_FORMATS["fp8"].row_bytes
BLOCK, MLP = 64, 18432
BF = torch.bfloat16
DSV32 = dict(
    model_type="deepseek_v32",
    num_hidden_layers=61,
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


def _w(g, *shape):
    return (torch.randn(*shape, device="cuda", generator=g) * shape[-1] ** -0.5).to(BF)


def weights(cfg: DSAConfig, g) -> dict:
    D, H, Q = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank
    one = lambda n: torch.ones(n, dtype=BF, device="cuda")  # noqa: E731
    return {
        "q_a_proj.weight": _w(g, Q, D),
        "q_a_layernorm.weight": one(Q),
        "q_b_proj.weight": _w(g, H * (cfg.qk_nope_head_dim + 64), Q),
        "kv_a_proj_with_mqa.weight": _w(g, 576, D),
        "kv_a_layernorm.weight": one(512),
        "kv_b_proj.weight": _w(g, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512),
        "o_proj.weight": _w(g, D, H * cfg.v_head_dim),
        "indexer.wq_b.weight": _w(g, cfg.index_n_heads * cfg.index_head_dim, Q),
        "indexer.wk.weight": _w(g, cfg.index_head_dim, D),
        "indexer.k_norm.weight": one(cfg.index_head_dim),
        "indexer.k_norm.bias": torch.zeros(cfg.index_head_dim, dtype=BF, device="cuda"),
        "indexer.weights_proj.weight": _w(g, cfg.index_n_heads, D),
        "norm": one(D),
        "mlp_norm": one(D),
        "w13": _w(g, 2 * MLP, D),
        "w2": _w(g, D, MLP),
    }


class Layer:
    """One layer's weights, key cache and row stores for ``batch`` requests of ``ctx`` tokens
    (the new token at position ``ctx``, outside every staged selection)."""

    def __init__(self, core, batch: int, ctx: int, hot: int, modes, g) -> None:
        cfg, dev = core.cfg, torch.device("cuda")
        self.core, self.w = core, weights(cfg, g)
        slots = batch * (ctx + BLOCK)
        self.cache = core.key_cache(slots // BLOCK, BLOCK, dev)
        self.store = self.host = None
        rows = torch.empty(slots, ROW, dtype=torch.uint8, device=dev)
        for s in range(0, slots, 1 << 18):
            e = min(slots, s + (1 << 18))
            idx = torch.arange(s, e, device=dev)
            core.store_keys(
                self.cache, idx, torch.randn(e - s, 128, device=dev, generator=g), BLOCK
            )
            rows[s:e] = encode_rows(torch.randn(e - s, 576, device=dev, generator=g), "fp8")
        if "resident" in modes:
            self.store = rows
        if "hisparse" in modes:
            self.host = torch.empty(slots, ROW, dtype=torch.uint8, pin_memory=True)
            self.host.copy_(rows)
            self.hot = torch.zeros(batch * hot, ROW, dtype=torch.uint8, device=dev)
            self.group = HiSparseIndexGroup(
                f"g{id(self)}", num_state_rows=batch, hot_size=hot, top_k=cfg.index_topk,
                max_batch=batch, num_keys=slots, device=dev,
            )  # fmt: skip
            self.rt = HiSparseRuntime(f"l{id(self)}", self.group, self.host, self.hot)
        del rows


class Step:
    def __init__(self, args, batch: int, modes) -> None:
        cfg = DSAConfig.from_hf(DSV32)
        self.core = SparseMLACore(cfg, "fp8", "cuda", attention=args.attention)
        assert self.core.kernel_rows and self.core.kernel_index, "the Triton kernels must run"
        g = torch.Generator(device="cuda").manual_seed(batch)
        ctx, dev = args.context, torch.device("cuda")
        n = args.layers
        self.layers = [Layer(self.core, batch, ctx, args.hot_size, modes, g) for _ in range(n)]
        blocks = ctx // BLOCK + 1
        bt = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
        self.tokens = TokenBatch(
            torch.full((batch,), ctx, device=dev), torch.arange(batch, device=dev),
            torch.full((batch,), ctx + 1, device=dev), bt, BLOCK,
        )  # fmt: skip
        self.new_slots = self.tokens.slots(self.tokens.positions.view(-1, 1)).view(-1)
        # bf16 like the model (vLLM's rotary keeps the activations' dtype)
        self.rope = tuple(t.to(BF) for t in Rotary(cfg, 163840, dev)(self.tokens.positions))
        self.x = torch.randn(batch, cfg.hidden_size, device=dev, generator=g).to(BF)
        self.sel = torch.zeros(batch, cfg.index_topk, dtype=torch.int64, device=dev)
        self.state_rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.src_rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.cfg, self.drift = cfg, Drift(batch, ctx, cfg.index_topk, args.miss, dev, seed=batch)

    def stage(self) -> None:
        """The next step's selection (outside the graph)."""
        self.drift.advance()
        self.sel.copy_(torch.topk(self.drift.bias, self.cfg.index_topk, dim=1).indices.sort(1)[0])

    def forward(self, mode: str) -> torch.Tensor:
        x, core, cfg, tok = self.x, self.core, self.cfg, self.tokens
        keys = tok.slots(self.sel)
        for lay in self.layers:
            w = lay.w
            h = rms_norm(x, w["norm"], 1e-6)
            q_resid, q_nope, q_pe, row = mla_inputs(h, w, cfg, self.rope)
            rows = encode_rows(row, "fp8")
            q, k, head_w = index_inputs(h, q_resid, w, cfg, self.rope)
            core.store_keys(lay.cache, self.new_slots, k, BLOCK)
            ranked = core.select(q, head_w, lay.cache, tok)
            if mode == "resident":
                lay.store.index_copy_(0, self.new_slots, rows)
                src, ids = lay.store, keys
            else:
                g = lay.group
                g.copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(g.copy_stream):  # the connector's save path
                    ops.save_rows([rows], [lay.host], self.src_rows, self.new_slots.int())
                ids = lay.rt.resolve(keys.to(torch.int32), self.state_rows)
                lay.rt.gather()
                lay.rt.wait_ready()
                src = lay.hot
            values = core.attend(q_nope, q_pe, w["kv_b_proj.weight"], src, ids)
            x = x + values @ w["o_proj.weight"].t() + 0 * ranked[:, :1]
            gu = rms_norm(x, w["mlp_norm"], 1e-6) @ w["w13"].t()
            x = x + (torch.nn.functional.silu(gu[:, :MLP]) * gu[:, MLP:]) @ w["w2"].t()
        return x


def run(args, batch: int, modes) -> dict:
    st = Step(args, batch, modes)
    graphs, outs = {}, {}
    for mode in modes:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                st.stage()
                st.forward(mode)
        torch.cuda.current_stream().wait_stream(side)
        graphs[mode] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[mode]):
            outs[mode] = st.forward(mode)
    groups = [lay.group for lay in st.layers if lay.host is not None]
    before = [g.counters[:2].view(torch.int64).clone() for g in groups]
    times = {m: [] for m in modes}
    identical = True
    for _ in range(args.rounds):
        for mode in modes:
            ev = []
            for _ in range(args.steps):
                st.stage()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graphs[mode].replay()
                b.record()
                ev.append((a, b))
            torch.cuda.synchronize()
            times[mode].append(statistics.median(a.elapsed_time(b) for a, b in ev))
        if len(modes) == 2:  # the same selection through both graphs
            for mode in modes:
                graphs[mode].replay()
            torch.cuda.synchronize()
            identical &= torch.equal(outs["resident"], outs["hisparse"])
    row = {"batch": batch}
    for m in modes:
        row[f"{m}_ms_per_step"] = round(statistics.median(times[m]), 4)
        row[f"{m}_spread_ms"] = [round(min(times[m]), 4), round(max(times[m]), 4)]
        row[f"{m}_tok_s"] = round(batch / statistics.median(times[m]) * 1e3, 1)
    if len(modes) == 2:
        same_round = zip(times["hisparse"], times["resident"])
        row["ratio"] = round(statistics.median(h / r for h, r in same_round), 4)
        row["bit_identical"] = identical
    if groups:
        hm = sum(g.counters[:2].view(torch.int64) - b for g, b in zip(groups, before))
        hits, misses = (int(v) for v in hm.tolist())
        row["hit_rate"] = round(hits / max(1, hits + misses), 4)
    del st, graphs, outs
    torch.cuda.empty_cache()
    return row


def profile_kernels(args, batch: int, top: int) -> None:
    """GPU time per eager step by kernel, for each mode (``--profile``)."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    both = ("resident", "hisparse")
    st = Step(args, batch, both)
    for mode in both:
        for _ in range(2):
            st.stage()
            st.forward(mode)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                st.stage()
                st.forward(mode)
            torch.cuda.synchronize()
        us = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us[e.name[:80]] += e.device_time / args.steps / args.layers
        print(f"\n{mode} batch {batch}: {sum(us.values()):.1f} us of kernels per layer")
        for name, t in us.most_common(top):
            print(f"{t:9.1f} us  {name}")
        ops = collections.Counter()  # the same time by the torch op that launched it
        for e in prof.key_averages():
            if e.self_device_time_total > 0:
                ops[e.key[:80]] += e.self_device_time_total / args.steps / args.layers
        print(f"\n{mode} batch {batch} by op:")
        for name, t in ops.most_common(top):
            print(f"{t:9.1f} us  {name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batches", default="1,16,30,64")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hot-size", type=int, default=4096)
    p.add_argument("--miss", type=float, default=0.05, help="new share of the top-k per step")
    p.add_argument("--attention", choices=("bmm", "fused"), default="bmm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capacity", action="store_true", help="each mode at its budget's limit")
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", type=int, default=0, help="print the top N kernels per mode")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dsa_core needs a CUDA GPU", file=sys.stderr)
        return 2
    both = ("resident", "hisparse")
    if args.profile:
        for b in (int(x) for x in args.batches.split(",") if x):
            profile_kernels(args, b, args.profile)
        return 0
    rows = []
    for b in (int(x) for x in args.batches.split(",") if x):
        t0 = time.time()
        rows.append(run(args, b, both))
        print(json.dumps(rows[-1]), f"({time.time() - t0:.0f} s)", flush=True)
    result = {
        "core": "hisparse.models.dsa.core",
        "device": torch.cuda.get_device_name(),
        "context": args.context,
        "layers": args.layers,
        "attention": args.attention,
        "miss": args.miss,
        "hot_size": args.hot_size,
        "rounds": args.rounds,
        "steps": args.steps,
        "mlp": f"dense SwiGLU {MLP} (the MoE's active width)",
        "batches": rows,
    }
    if args.capacity:
        gc = GraphConfig.deepseek_v32(ctx_len=args.context, hot_size=args.hot_size)
        budget = MemoryBudget()
        limit = {m: budget.max_batch(gc, m == "resident") for m in both}
        caps = {m: run(args, limit[m], (m,)) for m in both}
        tok = {m: caps[m][f"{m}_tok_s"] for m in both}
        result["capacity"] = {
            "budget_gib": budget.kv_gib,
            "max_batch": limit,
            "tok_s": tok,
            "ratio": round(tok["hisparse"] / tok["resident"], 3),
            "hit_rate": caps["hisparse"].get("hit_rate"),
        }
        print(json.dumps(result["capacity"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
