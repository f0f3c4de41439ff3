"""The in-read on a GPU (marked ``cuda``): HiSparse steps whose misses the row read fetches from
the pinned pool give the same bits, the same hot rows and the same counters as steps whose
misses the resolve op's gather copied in first, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import encode_rows
from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime
from hisparse.runtime.miss_plan import defer_misses, pending_table
from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]
GPU = torch.device("cuda")
B, K, HOT, KEYS = 6, 64, 128, 4096


def _cfg() -> DSAConfig:
    return DSAConfig.from_hf(random_config("deepseek_v32", index_topk=K, num_attention_heads=16))


class _Side:
    """One HiSparse layer: pinned pool, hot buffer, group, runtime, and a core reading misses
    one way (``misses``)."""

    def __init__(self, cfg, host_rows: torch.Tensor, misses: str) -> None:
        self.host = torch.empty_like(host_rows, pin_memory=True).copy_(host_rows)
        self.hot = torch.zeros(B * HOT, host_rows.shape[1], dtype=torch.uint8, device=GPU)
        self.group = HiSparseIndexGroup(
            f"g-{misses}", num_state_rows=B, hot_size=HOT, top_k=K, max_batch=B,
            num_keys=KEYS, device=GPU,
        )  # fmt: skip
        self.rt = HiSparseRuntime(f"l-{misses}", self.group, self.host, self.hot)
        self.core = SparseMLACore(cfg, "fp8", GPU, attention="bmm", misses=misses)
        self.rows = torch.arange(B, dtype=torch.int32, device=GPU)

    def step(self, keys, q_nope, q_pe, kv_b) -> torch.Tensor:
        ids = self.rt.resolve(keys, self.rows)
        if self.core.reads_misses(B):
            return self.core.attend(q_nope, q_pe, kv_b, self.hot, ids, defer_misses(self.rt))
        self.rt.gather()
        self.rt.wait_ready()
        return self.core.attend(q_nope, q_pe, kv_b, self.hot, ids)


def _inputs(cfg, seed: int):
    g = torch.Generator(device=GPU).manual_seed(seed)
    q_nope = torch.randn(B, 16, cfg.qk_nope_head_dim, device=GPU, generator=g)
    q_pe = torch.randn(B, 16, 64, device=GPU, generator=g)
    return q_nope.bfloat16(), q_pe.bfloat16()


def _keys(step: int) -> torch.Tensor:
    """Each request's top-k drifting by a few keys a step (hits and misses), some padding."""
    g = torch.Generator().manual_seed(100 + step)
    base = torch.arange(K)[None, :] + step * 5 + torch.arange(B)[:, None] * (KEYS // B)
    keys = torch.where(torch.rand(B, K, generator=g) < 0.1, base + 200, base).int()
    keys[1, K - 7 :] = -1
    return keys.sort(dim=1).values.to(GPU)


def test_in_read_equals_the_gather_first_eagerly_and_replayed():
    cfg = _cfg()
    g = torch.Generator(device=GPU).manual_seed(0)
    host_rows = encode_rows(torch.randn(KEYS, 576, device=GPU, generator=g), "fp8").cpu()
    kv_b = (
        0.05
        * torch.randn(
            16 * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512, device=GPU, generator=g
        ).bfloat16()
    )
    sides = {m: _Side(cfg, host_rows, m) for m in ("gather", "in_read")}
    assert sides["in_read"].core.reads_misses(B) and not sides["gather"].core.reads_misses(B)
    for s in range(4):  # eager steps: the first all misses, then a drifting mix
        q_nope, q_pe = _inputs(cfg, s)
        out = {m: side.step(_keys(s), q_nope, q_pe, kv_b) for m, side in sides.items()}
        assert torch.equal(out["gather"], out["in_read"]), f"step {s}"
    # captured: both sides' step in one graph each, replayed over new selections
    static_keys = _keys(4).clone()
    q_nope, q_pe = _inputs(cfg, 4)
    graphs, outs = {}, {}
    for m, side in sides.items():
        side.step(static_keys, q_nope, q_pe, kv_b)  # warm (same selection: all hits)
        torch.cuda.synchronize()
        graphs[m] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[m]):
            outs[m] = side.step(static_keys, q_nope, q_pe, kv_b)
    for s in range(5, 9):
        static_keys.copy_(_keys(s))
        for m in sides:
            graphs[m].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs["gather"], outs["in_read"]), f"replay {s}"
    a, b = sides["gather"], sides["in_read"]
    assert torch.equal(a.hot, b.hot), "the in-read left other bytes in the hot rows"
    assert torch.equal(a.group.counters, b.group.counters), "hits, misses or moved bytes differ"
    hits, misses, moved = (int(v) for v in b.group.counters.view(torch.int64).tolist())
    assert hits > 0 and misses > 0 and moved == misses * 656
    assert bool((pending_table(b.group) == -1).all()), "the table must be empty between reads"
