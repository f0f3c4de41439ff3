"""One decode step of the GPU-bound engine, in a form a CUDA graph can capture.

The batch is cut into parts; each part is resident (attention reads the device rows by id
b*ctx + position) or host (the part's own `HiSparseIndexGroup` per layer resolves the same ids
into rows of this step's hot buffers and its `HiSparseRuntime` gathers the misses from the pinned
host pool). Modes:

* ``resident``: every request resident;
* ``hisparse``: every request on the host pool (always-host);
* ``hybrid``: the first `resident` requests resident, the rest on the host pool.

``split=2`` cuts resident / hisparse batches into two halves. Per layer the step runs every
part's indexer and top-k first, starting each host part's gather as soon as its top-k is resolved
(the op's; MISS_PATHS says when the others start), then the query projection for the whole
batch, then each part's attention: part 0's copy runs under part 1's indexer and the query
projection, part 1's under part 0's attention. The only sync with the copies is each part's
`wait_ready` right before its attention reads the rows (``overlap=False`` waits right after
starting the copy instead: the no-overlap reference).
``misses`` (`MISS_PATHS`) says how a host part's misses reach its row read, ``attention``
(`ATTENTION`) how attention reads the rows.

Everything the step reads that changes between steps (the selection bias) lives in static
buffers staged before a replay; the step writes its next input (the embedding of the token it
picked) itself, so replays chain with no host work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from hisparse.engine.graph import kernels, miss_kernels
from hisparse.engine.graph import model as M
from hisparse.engine.graph.config import ROW_BYTES, GraphConfig
from hisparse.engine.graph.kv import HOT_POISON, KVStore
from hisparse.models.dsa.kernels import mla as mla_kernel
from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime

MODES = ("resident", "hisparse", "hybrid")
# How a host part's misses reach its row read: "op" the resolve op's gather on the copy stream,
# then the whole read; "in_read" read from the host pool inside the row read; "beside" a Triton
# copy on the copy stream, started after the query projection, while the rows already hot are
# read, then the misses' rows.
MISS_PATHS = ("op", "in_read", "beside")
# Attention over the selected rows: "bmm" decodes them into a bf16 buffer, then two batched
# products and a bf16 softmax; "fused" one Triton kernel over the FP8 rows (mla_kernel).
ATTENTION = ("bmm", "fused")


@dataclass
class Part:
    start: int
    end: int
    host: bool
    state_rows: Optional[torch.Tensor] = None
    runtimes: list = field(default_factory=list)  # one per layer (host parts)

    @property
    def size(self) -> int:
        return self.end - self.start


def make_parts(mode: str, batch: int, split: int = 1, resident: int = 0) -> list:
    """[(start, end, host)] of a mode; see the module docstring. In resident and hisparse mode
    `resident` > 0 cuts the batch where hybrid would (the same parts, for parity with it)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if (mode == "hybrid" or resident) and not 0 < resident < batch:
        raise ValueError(f"a cut needs 0 < resident < batch, got {resident} of {batch}")
    if mode == "hybrid":
        return [(0, resident, False), (resident, batch, True)]
    if split not in (1, 2) or (split == 2 and batch < 2):
        raise ValueError(f"split must be 1, or 2 with batch >= 2; got {split} at batch {batch}")
    cuts = [0, batch] if split == 1 else [0, batch // 2, batch]
    cuts = [0, resident, batch] if resident else cuts
    return [(a, b, mode == "hisparse") for a, b in zip(cuts[:-1], cuts[1:])]


class DecodeStep:
    """Static buffers plus `forward()`, the captured work of one step for `batch` requests."""

    def __init__(
        self,
        cfg: GraphConfig,
        weights: M.Weights,
        kv: KVStore,
        mode: str,
        batch: int,
        *,
        split: int = 1,
        resident: int = 0,
        overlap: bool = True,
        fused: Optional[bool] = None,
        misses: str = "op",
        attention: str = "bmm",
    ) -> None:
        if not 1 <= batch <= kv.max_batch:
            raise ValueError(f"batch must lie in [1, {kv.max_batch}], got {batch}")
        self.cfg, self.w, self.kv, self.mode, self.batch = cfg, weights, kv, mode, batch
        self.overlap = overlap  # False: wait for each copy right after starting it (no overlap)
        dev = kv.device
        self.fused = kernels.use_triton(fused, dev)  # else the torch path
        self.fused_indexer = self.fused and kernels.indexer_fits(cfg.idx_heads, cfg.idx_dim)
        if misses not in MISS_PATHS:
            raise ValueError(f"misses must be one of {MISS_PATHS}, got {misses!r}")
        if misses != "op" and not self.fused:
            raise ValueError(f"misses={misses!r} needs the Triton kernels (fused)")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if attention == "fused" and not self.fused:
            raise ValueError("attention='fused' needs the Triton kernels (fused)")
        if attention == "fused" and misses == "in_read":
            raise ValueError(
                "attention='fused' reads rows from one buffer: misses='op' or 'beside'"
            )
        self.misses, self.attention = misses, attention
        # One split count for every part: results then do not depend on how the batch is cut.
        self.splits = mla_kernel.splits_for(batch, cfg.heads, dev) if attention == "fused" else 1
        self.parts = [Part(a, b, h) for a, b, h in make_parts(mode, batch, split, resident)]
        # This step's own hot buffers (request b at rows b*hot_size ...), poisoned: a row no
        # gather wrote breaks parity instead of passing unnoticed.
        n_hot = batch * cfg.hot_size if any(p.host for p in self.parts) else 0
        self.hot = [
            torch.full((n_hot, ROW_BYTES), HOT_POISON, dtype=torch.uint8, device=dev)
            for _ in range(cfg.layers)
        ]
        for i, p in enumerate(self.parts):
            if p.host:
                self._bind(i, p)
        # pending[hot row] = its host key while a planned miss waits for the row read (the
        # bmm attention's in-read and two-part reads; the fused one reads whole hot rows).
        self.pending = None
        if misses != "op" and attention == "bmm":
            self.pending = torch.full((n_hot,), -1, dtype=torch.int32, device=dev)
        self.req_base = torch.arange(batch, device=dev, dtype=torch.int64)[:, None] * cfg.ctx_len
        self.x = torch.zeros(batch, cfg.hidden, dtype=M.DT, device=dev)
        self.bias = torch.zeros(batch, cfg.ctx_len, dtype=torch.float32, device=dev)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(batch, cfg.hidden, dtype=M.DT, device=dev)
        self.probe = None  # profile.Probe in the eager profile run; None when captured

    def _bind(self, i: int, p: Part) -> None:
        """One index group per layer for the part's requests: state row j is request start + j,
        its hot buffer the rows (start + j) * hot_size ... of this step's hot tensor."""
        cfg, kv = self.cfg, self.kv
        p.state_rows = torch.arange(p.size, dtype=torch.int32, device=kv.device)
        for layer in range(cfg.layers):
            g = HiSparseIndexGroup(
                f"layer{layer}.part{i}",
                num_state_rows=p.size,
                hot_size=cfg.hot_size,
                top_k=cfg.top_k,
                max_batch=p.size,
                num_keys=kv.max_batch * cfg.ctx_len,
                device=kv.device,
                hot_base=p.start * cfg.hot_size,
            )
            rt = HiSparseRuntime(f"layer{layer}", g, kv.host_views[layer], self.hot[layer])
            p.runtimes.append(rt)

    @property
    def groups(self) -> list:
        return [rt.index_group for p in self.parts if p.host for rt in p.runtimes]

    def stage(self, bias: torch.Tensor) -> None:
        """What changes between steps, copied in before a replay (outside the graph)."""
        self.bias.copy_(bias[: self.batch])

    def forward(self) -> None:
        h = self.x
        for layer in range(self.cfg.layers):
            h = self._layer(layer, h)
        logits = M.rms_norm(h, self.w.final_norm) @ self.w.embed.t()
        tok = logits.argmax(dim=-1)
        self.tokens.copy_(tok)
        self.hidden.copy_(h)
        self.x.copy_(self.w.embed.index_select(0, tok))

    def _layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w.layers[layer]
        a = M.rms_norm(h, w["attn_norm"])
        qr = M.rms_norm(a @ w["q_a"], w["q_norm"])
        rows = [self._rows(layer, i, p, qr, a) for i, p in enumerate(self.parts)]
        q = M.query(cfg, w, qr)
        mixes = []
        for i, (p, r) in enumerate(zip(self.parts, rows)):
            if self.attention == "fused":
                if p.host:  # fused attention reads the hot rows once the copy landed
                    self._wait(layer, i, p)
                src = self.hot[layer] if p.host else self.kv.dev_rows[layer]
                mixes.append(M.attend_rows(cfg, q[p.start : p.end], src, r, self.splits))
                continue
            kv = (
                self._read(layer, i, p, r)
                if p.host
                else M.read_rows(self.kv.dev_rows[layer], r, self.fused)
            )
            mixes.append(M.attend(cfg, q[p.start : p.end], kv))
        mix = mixes[0] if len(mixes) == 1 else torch.cat(mixes)
        h = h + M.attn_out(cfg, w, mix)
        return h + M.mlp(cfg, w, h)

    def _rows(self, layer: int, i: int, p: Part, qr, a) -> torch.Tensor:
        """Rows attention reads for the part [n, top_k]; starts a host part's gather."""
        s, e, w = p.start, p.end, self.w.layers[layer]
        keys = (self.kv.idx_keys[layer][s:e], self.kv.idx_scales[layer][s:e])
        scores = M.indexer_scores(self.cfg, w, qr[s:e], a[s:e], keys, self.fused_indexer)
        pos = M.select(scores, self.bias[s:e], self.cfg.top_k)
        ids = pos + self.req_base[s:e]  # resident row id == host row id of (request, position)
        if not p.host:
            return ids
        rt = p.runtimes[layer]
        self._mark("res0", layer, i)
        out = rt.resolve(ids.to(torch.int32), p.state_rows)
        self._mark("res1", layer, i)
        if self.pending is not None:
            miss_kernels.stage_misses(self.pending, *rt.index_group.plan())
        if self.misses == "op" or self.attention == "fused":
            self._copy(layer, i, p)
        return out

    def _copy(self, layer: int, i: int, p: Part) -> None:
        """Start the part's copy of this layer's misses on the copy stream."""
        rt = p.runtimes[layer]
        rt.gather(copy=miss_kernels.copy_misses if self.misses == "beside" else None)
        self._mark("copy1", layer, i, rt.index_group.copy_stream)
        if not self.overlap:
            rt.wait_ready()

    def _read(self, layer: int, i: int, p: Part, r: torch.Tensor) -> torch.Tensor:
        """A host part's rows as attention reads them, once its misses are in (see MISS_PATHS)."""
        hot, rt = self.hot[layer], p.runtimes[layer]
        if self.misses == "in_read":
            kv = miss_kernels.read_rows_from_host(hot, self.kv.host_views[layer], self.pending, r)
            g = rt.index_group
            miss_kernels.stage_misses(self.pending, *g.plan(), clear=True, moved=g.moved_bytes)
            return kv
        kv = None
        if self.misses == "beside":  # the rows already hot while their copy is in flight
            copy_stream = rt.index_group.copy_stream
            if copy_stream is not None:
                # Not before the query projection: its GEMMs' grids would wait on the SMs the
                # copy holds. Beside the row read the two share the GPU.
                copy_stream.wait_stream(torch.cuda.current_stream())
            self._copy(layer, i, p)
            kv = kernels.gather_decode(hot, r, pending=self.pending, part="hits")
        self._wait(layer, i, p)
        if kv is None:
            return M.read_rows(hot, r, self.fused)
        kernels.gather_decode(hot, r, pending=self.pending, part="misses", out=kv)
        miss_kernels.stage_misses(self.pending, *rt.index_group.plan(), clear=True)
        return kv

    def _wait(self, layer: int, i: int, p: Part) -> None:
        """The current stream waits for the part's copy of this layer (marked for the profile)."""
        self._mark("wait0", layer, i)
        p.runtimes[layer].wait_ready()
        self._mark("wait1", layer, i)

    def _mark(self, what: str, layer: int, i: int, stream=None) -> None:
        if self.probe is not None:
            self.probe.mark((what, layer, i), stream)
