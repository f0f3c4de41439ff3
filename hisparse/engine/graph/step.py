"""One decode step of layers of the DSA attention core (``hisparse.models.dsa.core``, the code
the vLLM classes and the DSA engine run) with random weights, in a form a CUDA graph captures.

Per layer: norms, the MLA and indexer projections with rotary (``hisparse.models.dsa``), the new
row and index key stored, the indexer's top-k (``core.select``), attention over the selected
rows (``core.attend``), o_proj and the MLP stand-in; after the last layer the final norm, the LM
head and a greedy token. Two modes over the same bytes:

* ``resident``: rows read by slot from the device row store;
* ``hisparse``: the new row saved to the host pool on the copy stream (as the connector saves),
  the selection resolved against each request's hot buffer (``hisparse.runtime``), the misses
  gathered from the host pool or (``core.reads_misses``) fetched by attention's row read,
  attention over the hot rows.

Which rows attention reads is a staged selection (``Drift``), so the hit rate is the run's
setting, not random weights'; the indexer's own ranking is computed every step all the same
(its slots feed the hidden state through a zero product, so no step skips it). The staged
selection lives in a static buffer written before a replay, so replays need no host work.
"""

from __future__ import annotations

import torch

from hisparse import ops
from hisparse.engine.graph.config import GraphConfig
from hisparse.engine.graph.drift import Drift
from hisparse.models.dsa.core import SparseMLACore, TokenBatch
from hisparse.models.dsa.decoder import Rotary
from hisparse.models.dsa.kernels import elementwise as ew
from hisparse.models.dsa.projections import index_inputs, mla_query, mla_row, norm
from hisparse.models.rows import ROW_FORMATS, encode_rows
from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime
from hisparse.runtime.miss_plan import defer_misses

MODES = ("resident", "hisparse")
ROW = ROW_FORMATS["fp8"].row_bytes
BLOCK = 64  # tokens per block of the paged caches (DeepSeek-V3.2's in vLLM)
DT = torch.bfloat16
_FILL = 1 << 18  # rows encoded per pass at set-up


def _w(g, device, *shape):
    return (torch.randn(*shape, device=device, generator=g) * shape[-1] ** -0.5).to(DT)


def layer_weights(cfg: GraphConfig, g: torch.Generator, device) -> dict:
    """One layer's weights under the checkpoint's names (``self_attn.*`` suffixes)."""
    D, H, Q, d = cfg.hidden, cfg.heads, cfg.q_lora, cfg.idx_dim
    one = lambda n: torch.ones(n, dtype=DT, device=device)  # noqa: E731
    return {
        "q_a_proj.weight": _w(g, device, Q, D),
        "q_a_layernorm.weight": one(Q),
        "q_b_proj.weight": _w(g, device, H * (cfg.nope + cfg.rope), Q),
        "kv_a_proj_with_mqa.weight": _w(g, device, cfg.kv_dim, D),
        "kv_a_layernorm.weight": one(cfg.latent),
        "kv_b_proj.weight": _w(g, device, H * (cfg.nope + cfg.v_head), cfg.latent),
        "o_proj.weight": _w(g, device, D, H * cfg.v_head),
        "indexer.wq_b.weight": _w(g, device, cfg.idx_heads * d, Q),
        "indexer.wk.weight": _w(g, device, d, D),
        "indexer.k_norm.weight": one(d),
        "indexer.k_norm.bias": torch.zeros(d, dtype=DT, device=device),
        "indexer.weights_proj.weight": _w(g, device, cfg.idx_heads, D),
        "norm": one(D),
        "mlp_norm": one(D),
        "w13": _w(g, device, 2 * cfg.mlp_inter, D),
        "w2": _w(g, device, D, cfg.mlp_inter),
    }


class Layer:
    """One layer's weights, index key cache and rows for ``batch`` requests of ``ctx_len``
    tokens each (the new token at position ``ctx_len``, past every staged selection): the
    device row store (resident) and / or the host pool, hot buffers and runtime (hisparse)."""

    def __init__(self, core: SparseMLACore, cfg: GraphConfig, batch: int, modes, g, device):
        self.w = layer_weights(cfg, g, device)
        slots = batch * (cfg.ctx_len + BLOCK)
        self.cache = core.key_cache(slots // BLOCK, BLOCK, device)
        rows = torch.empty(slots, ROW, dtype=torch.uint8, device=device)
        for s in range(0, slots, _FILL):
            e = min(slots, s + _FILL)
            idx = torch.arange(s, e, device=device)
            k = torch.randn(e - s, cfg.idx_dim, device=device, generator=g)
            core.store_keys(self.cache, idx, k, BLOCK)
            kv = torch.randn(e - s, cfg.kv_dim, device=device, generator=g)
            rows[s:e] = encode_rows(kv, "fp8")
        self.store = rows if "resident" in modes else None
        self.host = self.hot = self.group = self.rt = None
        if "hisparse" in modes:
            pin = torch.device(device).type == "cuda"
            self.host = torch.empty(slots, ROW, dtype=torch.uint8, pin_memory=pin)
            self.host.copy_(rows)
            self.hot = torch.zeros(batch * cfg.hot_size, ROW, dtype=torch.uint8, device=device)
            self.group = HiSparseIndexGroup(
                f"g{id(self)}", num_state_rows=batch, hot_size=cfg.hot_size, top_k=cfg.top_k,
                max_batch=batch, num_keys=slots, device=device,
            )  # fmt: skip
            self.rt = HiSparseRuntime(f"l{id(self)}", self.group, self.host, self.hot)


class CoreStep:
    """Static buffers and ``forward(mode)`` for ``batch`` requests: what one replay runs."""

    def __init__(
        self,
        cfg: GraphConfig,
        batch: int,
        modes=MODES,
        device="cuda",
        *,
        attention: str = "bmm",
        misses: str = "auto",
        indexer: str = "auto",
        miss: float = 0.05,
    ) -> None:
        if not batch >= 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if not set(modes) <= set(MODES) or not modes:
            raise ValueError(f"modes must be among {MODES}, got {modes!r}")
        cfg.check()
        dev = torch.device(device)
        self.cfg, self.batch, self.modes, self.device = cfg, batch, tuple(modes), dev
        self.dsa = cfg.dsa_config()
        self.core = SparseMLACore(
            self.dsa, "fp8", dev, attention=attention, misses=misses, indexer=indexer
        )
        g = torch.Generator(device=dev).manual_seed(cfg.seed + batch)
        self.layers = [Layer(self.core, cfg, batch, modes, g, dev) for _ in range(cfg.layers)]
        self.final_norm = torch.ones(cfg.hidden, dtype=DT, device=dev)
        self.lm_head = _w(g, dev, cfg.vocab, cfg.hidden)
        ctx, blocks = cfg.ctx_len, cfg.ctx_len // BLOCK + 1
        bt = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
        self.tokens = TokenBatch(
            torch.full((batch,), ctx, device=dev), torch.arange(batch, device=dev),
            torch.full((batch,), ctx + 1, device=dev), bt, BLOCK,
        )  # fmt: skip
        self.new_slots = self.tokens.slots(self.tokens.positions.view(-1, 1)).view(-1)
        self.new_slots32 = self.new_slots.int()  # the host pool's ops take int32 slots
        # bf16 like the model (vLLM's rotary keeps the activations' dtype)
        rope = Rotary(self.dsa, ctx + 1, dev)(self.tokens.positions)
        self.rope = tuple(t.to(DT) for t in rope)
        self.x = torch.randn(batch, cfg.hidden, device=dev, generator=g).to(DT)
        self.sel = torch.zeros(batch, cfg.top_k, dtype=torch.int64, device=dev)
        self.state_rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.drift = Drift(batch, ctx, cfg.top_k, miss, dev, seed=cfg.seed + batch)
        self.reads_misses = self.core.reads_misses(batch)

    @property
    def groups(self) -> list:
        return [lay.group for lay in self.layers if lay.group is not None]

    def stage(self) -> None:
        """The next step's selection (outside the graph)."""
        self.drift.advance()
        top = torch.topk(self.drift.bias, self.cfg.top_k, dim=1).indices
        self.sel.copy_(top.sort(dim=1).values)

    def forward(self, mode: str) -> tuple:
        """(greedy tokens [batch], final hidden state [batch, hidden]) of one step."""
        if mode not in self.modes:
            raise ValueError(f"this step was built for {self.modes}, not {mode!r}")
        x, core, dsa, tok = self.x, self.core, self.dsa, self.tokens
        keys = tok.slots(self.sel)
        keys32 = keys.to(torch.int32) if mode != "resident" else None  # once, not per layer
        fused = core.kernel_rows
        for lay in self.layers:
            w = lay.w
            h = norm(x, w["norm"], 1e-6, kernels=fused)
            q_resid, row = mla_row(h, w, dsa, self.rope, kernels=fused)
            rows = core.encode_rows(row)
            q, k, head_w = index_inputs(h, q_resid, w, dsa, self.rope, kernels=fused)
            core.store_keys(lay.cache, self.new_slots, k, BLOCK)
            if mode == "resident":
                ranked = core.select(q, head_w, lay.cache, tok)
                lay.store.index_copy_(0, self.new_slots, rows)
                src, ids, misses = lay.store, keys, None
            else:
                self._save(lay, rows)
                ranked = core.select(q, head_w, lay.cache, tok)
                src, ids = lay.hot, self._resolve(lay, keys32)
                misses = defer_misses(lay.rt) if self.reads_misses else None
            # Both modes in one order; HiSparse's misses copy in meanwhile (copy stream).
            kv_b = w["kv_b_proj.weight"]
            query = core.query(*mla_query(q_resid, w, dsa, self.rope, kernels=fused), kv_b)
            if mode != "resident" and misses is None:
                lay.rt.wait_ready()
            values = core.attend_query(query, kv_b, src, ids, misses)
            x = x + values @ w["o_proj.weight"].t() + 0 * ranked[:, :1]
            gu = norm(x, w["mlp_norm"], 1e-6, kernels=fused) @ w["w13"].t()
            gate, up = gu.split(self.cfg.mlp_inter, dim=1)
            if fused and ew.supported(gate):
                act = ew.silu_mul(gate, up)
            else:
                act = torch.nn.functional.silu(gate) * up
            x = x + act @ w["w2"].t()
        hidden = norm(x, self.final_norm, 1e-6, kernels=fused)
        return (hidden @ self.lm_head.t()).argmax(dim=-1), hidden

    def _save(self, lay: Layer, rows: torch.Tensor) -> None:
        """The connector's save of the new rows to the host pool, on the copy stream."""
        args = ([rows], [lay.host], self.state_rows, self.new_slots32)
        if self.device.type != "cuda":
            ops.save_rows(*args)
            return
        lay.group.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(lay.group.copy_stream):
            ops.save_rows(*args)

    def _resolve(self, lay: Layer, keys32: torch.Tensor) -> torch.Tensor:
        """The requests resolved against their hot buffers (the rows attention reads) and,
        unless the row read fetches the misses itself, their gather launched on the copy
        stream (the caller waits for it with ``lay.rt.wait_ready`` once it needs the rows)."""
        ids = lay.rt.resolve(keys32, self.state_rows)
        if not self.reads_misses:
            lay.rt.gather()
        return ids
