"""run_workload: continuous batching of the reference workload in resident or HiSparse mode."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Union

import torch

from hisparse.engine.config import EngineConfig, request_lengths
from hisparse.engine.kvformat import LATENT_DIM, decode_rows, encode_rows
from hisparse.engine.kvstore import BINDING_FAULTS, HiSparseKV, ResidentKV, StepRows
from hisparse.engine.model import Model, ema_matrix, select_top_k

MODES = ("resident", "hisparse")
# Max elements of one prefill attention gather ([chunk, top_k, 576] values).
_PREFILL_CHUNK_ELEMS = 1 << 25


@dataclass
class RunStats:
    mode: str
    device: str
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    host_to_device_bytes: int = 0
    host_pool_bytes: int = 0
    host_pool_used_bytes: int = 0
    device_kv_bytes: int = 0
    indexer_bytes: int = 0
    topk_overlap: float = 0.0
    peak_running: int = 0
    snapshots: int = 0
    connector: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunResult:
    mode: str
    device: str
    config: EngineConfig
    tokens: List[List[int]]
    final_hidden: torch.Tensor
    stats: RunStats
    attention: Optional[Dict[str, torch.Tensor]] = None


class _Request:
    __slots__ = ("idx", "rid", "prompt", "prompt_len", "output_len", "slot", "generated")

    def __init__(self, idx: int, prompt: torch.Tensor, output_len: int) -> None:
        self.idx = idx
        self.rid = f"req-{idx}"
        self.prompt = prompt
        self.prompt_len = int(prompt.numel())
        self.output_len = output_len
        self.slot = -1
        self.generated = 0

    @property
    def pos(self) -> int:
        """Position of the token fed in this decode step (= tokens already in the KV)."""
        return self.prompt_len + self.generated - 1


def make_requests(cfg: EngineConfig) -> List[_Request]:
    prompts, outputs = request_lengths(cfg)
    g = torch.Generator().manual_seed(cfg.seed + 7919)
    reqs = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        toks = torch.randint(0, cfg.vocab, (p,), generator=g, dtype=torch.int64)
        reqs.append(_Request(i, toks, o))
    return reqs


class Engine:
    """One run of the reference workload. Use ``run_workload``."""

    def __init__(self, cfg: EngineConfig, mode: str, device: torch.device, *,
                 record_attention: bool = False, binding_fault: Optional[str] = None,
                 on_stats: Optional[Callable] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if binding_fault not in BINDING_FAULTS:
            raise ValueError(f"binding_fault must be one of {BINDING_FAULTS}, got {binding_fault!r}")
        self.cfg, self.mode, self.device = cfg, mode, device
        self.model = Model(cfg, device)
        self.dtype = self.model.dtype
        S, C = cfg.num_state_rows, cfg.max_context
        if mode == "resident":
            self.kv = ResidentKV(cfg, device, binding_fault)
        else:
            self.kv = HiSparseKV(cfg, device, binding_fault, on_stats=on_stats)
        self.idx_cache = [torch.zeros(S, C, cfg.indexer_dim, dtype=self.dtype, device=device)
                          for _ in range(cfg.num_groups)]
        self.qstate = [torch.zeros(S, cfg.indexer_dim, dtype=self.dtype, device=device)
                       for _ in range(cfg.num_groups)]
        self.indexer_bytes = sum(t.numel() * t.element_size() for t in self.idx_cache)
        self.prev_sel = torch.zeros(S, C, dtype=torch.bool, device=device)
        self.overlap_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.overlap_cnt = torch.zeros((), dtype=torch.float64, device=device)
        self.cur_tok = torch.zeros(S, dtype=torch.int64, device=device)
        self.record_attention = record_attention
        self.attn: List[List[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]

    # ---- one forward: decode rows first (batch order), then the newly admitted prefills ------
    def forward(self, dec: List[_Request], new: List[_Request], out_tokens: torch.Tensor,
                final_hidden: torch.Tensor) -> None:
        cfg, m, dev = self.cfg, self.model, self.device
        C, K, R = cfg.max_context, cfg.top_k, cfg.recent_window
        W = getattr(self.kv, "window", 1)
        Bd = len(dec)
        if Bd:
            slots_l = [r.slot for r in dec]
            pos_l = [r.pos for r in dec]
            slots = torch.tensor(slots_l, dtype=torch.int64).to(dev, non_blocking=True)
            pos = torch.tensor(pos_l, dtype=torch.int64).to(dev, non_blocking=True)
            keys_cpu = torch.tensor([s * C + p for s, p in zip(slots_l, pos_l)], dtype=torch.int64)
            keys = keys_cpu.to(dev, non_blocking=True)
            x = m.embed(self.cur_tok[slots])
            T = max(pos_l) + 1
            win_d = slots * W + pos.remainder(W)
        xp, posp, keysp_cpu, keysp, winp, winp_src = [], [], [], [], [], []
        off = Bd
        for r in new:
            P = r.prompt_len
            xp.append(m.embed(r.prompt.to(dev)))
            pp = torch.arange(P, dtype=torch.int64)
            posp.append(pp.to(dev))
            kc = r.slot * C + pp
            keysp_cpu.append(kc)
            keysp.append(kc.to(dev))
            lo = max(0, P - W)
            wp = torch.arange(lo, P, dtype=torch.int64)
            winp.append((r.slot * W + wp.remainder(W)).to(dev))
            winp_src.append((off + wp).to(dev))
            off += P
        parts_keys_cpu = ([keys_cpu] if Bd else []) + keysp_cpu
        all_keys_cpu = torch.cat(parts_keys_cpu)
        all_keys = torch.cat(([keys] if Bd else []) + keysp)
        win_rows = torch.cat(([win_d] if Bd else []) + winp)
        win_src = torch.cat(([torch.arange(Bd, device=dev)] if Bd else []) + winp_src)
        sel = selp = None
        for layer in range(cfg.num_layers):
            g = cfg.group_of(layer)
            leader = cfg.is_leader(layer)
            rows_parts, hp_list, qp_list, kvb_p = [], [], [], []
            if Bd:
                h, kv, q = m.project(x, layer, pos)
                rows_d = encode_rows(kv, cfg.row_layout)
                rows_parts.append(rows_d)
            for i, r in enumerate(new):
                hp, kvp, qp = m.project(xp[i], layer, posp[i])
                b = encode_rows(kvp, cfg.row_layout)
                rows_parts.append(b)
                kvb_p.append(b)
                hp_list.append(hp)
                qp_list.append(qp)
            self.kv.store(layer, StepRows(torch.cat(rows_parts), all_keys, all_keys_cpu, win_rows, win_src))
            if leader:
                if Bd:
                    ik = m.index_key(h, g)
                    self.idx_cache[g][slots, pos] = ik
                    u = m.index_query(h, g)
                    a = cfg.drift
                    qs = (1.0 - a) * self.qstate[g][slots] + a * u
                    self.qstate[g][slots] = qs
                    scores = torch.einsum("bd,btd->bt", qs, self.idx_cache[g][slots, :T])
                    sel = select_top_k(scores, pos + 1, K, R)
                    if g == 0:
                        self._overlap(slots, sel)
                selp = []
                for i, r in enumerate(new):
                    P = r.prompt_len
                    ikp = m.index_key(hp_list[i], g)
                    self.idx_cache[g][r.slot, :P] = ikp
                    up = m.index_query(hp_list[i], g)
                    qa = ema_matrix(P, cfg.drift, self.dtype, dev) @ up
                    self.qstate[g][r.slot] = qa[-1]
                    sp = select_top_k(qa @ ikp.T, posp[i] + 1, K, R)
                    selp.append(sp)
                    if g == 0:
                        self.prev_sel[r.slot].zero_()
                        last = sp[-1]
                        self.prev_sel[r.slot, last[last >= 0]] = True
            if Bd:
                sel_keys = torch.where(sel >= 0, slots.unsqueeze(1) * C + sel, sel)
                rows = self.kv.read(layer, sel_keys, sel, pos, slots, len(new))
                kvs = decode_rows(rows, cfg.row_layout, self.dtype)
                o = m.attend(q, kvs, sel >= 0)
                if self.record_attention:
                    self.attn[layer].append(o)
                x = m.finish_layer(x, o, layer)
            for i, r in enumerate(new):
                vals = decode_rows(kvb_p[i], cfg.row_layout, self.dtype)
                xp[i] = m.finish_layer(xp[i], self._prefill_attend(qp_list[i], vals, selp[i]), layer)
        if Bd:
            tok = m.logits(x).argmax(dim=-1)
            self.cur_tok[slots] = tok
            ridx = torch.tensor([r.idx for r in dec], dtype=torch.int64).to(dev, non_blocking=True)
            gidx = torch.tensor([r.generated for r in dec], dtype=torch.int64).to(dev, non_blocking=True)
            out_tokens[ridx, gidx] = tok
            last = [i for i, r in enumerate(dec) if r.generated + 1 == r.output_len]
            if last:
                li = torch.tensor(last, dtype=torch.int64).to(dev, non_blocking=True)
                final_hidden[ridx[li]] = x[li]
        for i, r in enumerate(new):
            xl = xp[i][-1:]
            tok = m.logits(xl).argmax(dim=-1)
            self.cur_tok[r.slot] = tok[0]
            out_tokens[r.idx, 0] = tok[0]
            if r.output_len == 1:
                final_hidden[r.idx] = xl[0]

    def _prefill_attend(self, q: torch.Tensor, vals: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """Sparse attention of every prompt position over its own selection, computed densely
        (scores against all prompt rows, unselected ones masked out): the same values as a
        gather, without materialising [P, top_k, 576]. Identical in both modes."""
        P = sel.shape[0]
        mask = torch.zeros(P, P + 1, dtype=torch.bool, device=sel.device)
        mask.scatter_(1, torch.where(sel >= 0, sel, torch.full_like(sel, P)), True)
        mask = mask[:, :P]
        chunk = max(1, _PREFILL_CHUNK_ELEMS // max(1, P))
        outs = []
        for s in range(0, P, chunk):
            sc = (q[s:s + chunk] @ vals.T) * self.model.scale
            sc = sc.masked_fill(~mask[s:s + chunk], float("-inf"))
            outs.append(torch.softmax(sc, dim=-1) @ vals[:, :LATENT_DIM])
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _overlap(self, slots: torch.Tensor, sel: torch.Tensor) -> None:
        valid = sel >= 0
        prev = self.prev_sel[slots].gather(1, sel.clamp(min=0))
        self.overlap_sum += (prev & valid).sum(dtype=torch.float64)
        self.overlap_cnt += valid.sum(dtype=torch.float64)
        fresh = torch.zeros_like(self.prev_sel[slots])
        fresh.scatter_(1, sel.clamp(min=0), valid)
        self.prev_sel[slots] = fresh


def _resolve_device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch sees no CUDA GPU")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    return dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_workload(
    config: EngineConfig,
    mode: str = "hisparse",
    device: Union[str, torch.device] = "cpu",
    *,
    record_attention: bool = False,
    binding_fault: Optional[str] = None,
    progress: Optional[Callable[[int], None]] = None,
    metrics=None,
) -> RunResult:
    """Run the whole workload (all requests to completion) and return tokens, hidden states and
    stats. ``metrics``: an object with ``observe(stats)`` (e.g. the CLI's Prometheus side)."""
    cfg = config
    dev = _resolve_device(device)
    from hisparse.stats import HiSparseKVConnectorStats  # noqa: F401  (connector's container)

    collected = {"agg": None, "n": 0}

    def on_stats(stats) -> None:
        # The path vLLM takes: the worker's stats object crosses a process boundary as its
        # plain `data`, the frontend rebuilds it with the connector's class method, aggregates
        # it, and hands the data to the Prometheus side.
        from hisparse.connector import HiSparseConnector

        rebuilt = HiSparseConnector.build_kv_connector_stats(dict(stats.data))
        if collected["agg"] is None:
            collected["agg"] = HiSparseConnector.build_kv_connector_stats(None)
        collected["agg"].aggregate(rebuilt)
        collected["n"] += 1
        if metrics is not None:
            metrics.observe(rebuilt.data)

    eng = Engine(cfg, mode, dev, record_attention=record_attention,
                 binding_fault=binding_fault, on_stats=on_stats)
    reqs = make_requests(cfg)
    N = len(reqs)
    max_out = max(r.output_len for r in reqs)
    out_tokens = torch.full((N, max_out), -1, dtype=torch.int64, device=dev)
    final_hidden = torch.zeros(N, cfg.hidden, dtype=eng.dtype, device=dev)
    waiting = deque(reqs)
    running: List[_Request] = []
    free_slots = list(range(cfg.num_state_rows))
    finished_ids: List[str] = []
    tokens_done = 0
    steps = 0
    peak_running = 0
    peak_host_rows = 0
    _sync(dev)
    t0 = time.perf_counter()
    try:
        while waiting or running:
            new: List[_Request] = []
            while waiting and free_slots:
                r = waiting.popleft()
                r.slot = free_slots.pop(0)
                new.append(r)
            dec = list(running)
            eng.kv.begin_step([r.rid for r in dec], [(r.rid, r.prompt_len) for r in new], finished_ids)
            finished_ids = []
            eng.forward(dec, new, out_tokens, final_hidden)
            for r in dec:
                r.generated += 1
            for r in new:
                r.generated = 1
            running.extend(new)
            peak_running = max(peak_running, len(running))
            held = sum(r.prompt_len + r.generated - 1 for r in running)
            peak_host_rows = max(peak_host_rows, held)
            tokens_done += len(dec) + len(new)
            still = []
            for r in running:
                if r.generated >= r.output_len:
                    free_slots.append(r.slot)
                    free_slots.sort()
                    eng.kv.finish(r.rid)
                    finished_ids.append(r.rid)
                else:
                    still.append(r)
            running = still
            eng.kv.end_step()
            steps += 1
            if progress is not None:
                progress(tokens_done)
        _sync(dev)
        wall = time.perf_counter() - t0
    finally:
        eng.kv.close()
    st = RunStats(mode=mode, device=str(dev))
    st.requests = N
    st.prompt_tokens = sum(r.prompt_len for r in reqs)
    st.generated_tokens = tokens_done
    st.steps = steps
    st.wall_s = wall
    st.tokens_per_s = tokens_done / wall if wall > 0 else 0.0
    st.host_pool_bytes = eng.kv.host_pool_bytes
    st.device_kv_bytes = eng.kv.device_kv_bytes
    st.indexer_bytes = eng.indexer_bytes
    if mode == "hisparse":
        st.host_pool_used_bytes = peak_host_rows * cfg.row_bytes * cfg.num_layers
    cnt = float(eng.overlap_cnt)
    st.topk_overlap = float(eng.overlap_sum) / cnt if cnt else 0.0
    st.peak_running = peak_running
    agg = collected["agg"]
    if agg is not None:
        tot = agg.totals()
        st.hits, st.misses = int(tot["hits"]), int(tot["misses"])
        st.host_to_device_bytes = int(tot["host_to_device_bytes"])
        st.connector = {k: v for k, v in agg.reduce().items()}
        st.snapshots = collected["n"]
    lookups = st.hits + st.misses
    st.hit_rate = st.hits / lookups if lookups else 0.0
    tokens = [out_tokens[r.idx, :r.output_len].tolist() for r in reqs]
    attention = None
    if record_attention:
        names = cfg.layer_names()
        attention = {names[i]: (torch.cat(a).cpu() if a else torch.zeros(0, LATENT_DIM, dtype=eng.dtype))
                     for i, a in enumerate(eng.attn)}
    return RunResult(mode=mode, device=str(dev), config=cfg, tokens=tokens,
                     final_hidden=final_hidden.cpu(), stats=st, attention=attention)


@dataclass
class Parity:
    ok: bool
    tokens_equal: bool
    hidden_equal: bool
    attention_equal: Optional[bool]
    mismatched_requests: List[int]
    first_mismatch: Optional[tuple]
    max_hidden_abs_diff: float

    def describe(self) -> str:
        if self.ok:
            return "parity OK: tokens and final hidden states are bit-identical"
        bits = []
        if not self.tokens_equal:
            bits.append(f"tokens differ in {len(self.mismatched_requests)} request(s), first at "
                        f"(request, position) = {self.first_mismatch}")
        if not self.hidden_equal:
            bits.append(f"final hidden states differ (max |diff| {self.max_hidden_abs_diff:.3g})")
        if self.attention_equal is False:
            bits.append("per-layer attention outputs differ")
        return "parity FAILED: " + "; ".join(bits)


def compare_runs(a: RunResult, b: RunResult) -> Parity:
    """Bit-exact comparison of two runs of the same workload."""
    if len(a.tokens) != len(b.tokens):
        raise ValueError(f"runs have different request counts ({len(a.tokens)} vs {len(b.tokens)})")
    mism, first = [], None
    for i, (ta, tb) in enumerate(zip(a.tokens, b.tokens)):
        if ta != tb:
            mism.append(i)
            if first is None:
                j = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                first = (i, j)
    ha, hb = a.final_hidden, b.final_hidden
    same_shape = ha.shape == hb.shape and ha.dtype == hb.dtype
    hidden_equal = bool(same_shape and torch.equal(ha, hb))
    diff = float((ha.double() - hb.double()).abs().max()) if same_shape and ha.numel() else (
        0.0 if same_shape else float("inf"))
    att = None
    if a.attention is not None and b.attention is not None:
        att = a.attention.keys() == b.attention.keys() and all(
            a.attention[k].shape == b.attention[k].shape and torch.equal(a.attention[k], b.attention[k])
            for k in a.attention)
    ok = not mism and hidden_equal and att is not False
    return Parity(ok, not mism, hidden_equal, att, mism, first, diff)
