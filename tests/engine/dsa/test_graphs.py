"""``DecodeGraphs``' policy on the CPU, with torch's CUDA graph and stream objects stood in by
recorders: prefill steps and the first decode step of a batch size run eagerly, the second is
captured and replayed, later ones copy their inputs into the captured buffers and replay; a
step that cannot be captured fails in one line naming the way out. (That replays equal eager
steps bit for bit is checked on a GPU in test_cuda.py.)"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from hisparse.engine.dsa import graphs
from hisparse.models.dsa.core import TokenBatch


class FakeGraph:
    made: list = []

    def __init__(self) -> None:
        self.replays, self.ended = 0, False
        FakeGraph.made.append(self)

    def capture_begin(self, pool=None) -> None:
        self.pool_in = pool

    def capture_end(self) -> None:
        self.ended = True

    def pool(self):
        return ("pool", id(FakeGraph.made[0]))

    def replay(self) -> None:
        self.replays += 1


class FakeStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeGraph.made = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


class Forward:
    """A forward pass that records each call: (batch size, tokens seen, eager or not)."""

    device = torch.device("cuda")
    max_context = 64

    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = [], fail

    def step(self, store, tokens, batch, last, num_decodes):
        if self.fail and len(self.calls) == 1:
            raise ValueError("an op that cannot be captured")
        self.calls.append((batch.seq_lens.shape[0], tokens.tolist()))
        return tokens.float()[:, None] * 2


class Store:
    """What the graphs ask of a row store: this step's ``graph_key``."""

    def __init__(self) -> None:
        self.key = ()

    def graph_key(self) -> tuple:
        return self.key


def _decode(n: int, step: int):
    tokens = torch.arange(n) + 10 * step
    pos = torch.full((n,), step)
    batch = TokenBatch(pos, torch.arange(n), pos + 1, torch.arange(n).view(n, 1), 64)
    return tokens, batch, torch.arange(n), n


def test_first_eager_second_captured_then_replayed(fake_cuda):
    fwd = Forward()
    run = graphs.DecodeGraphs(fwd, store=Store())
    out = [run.step(*_decode(3, s)) for s in range(4)]
    # step 0 eager, step 1 captured (the forward's Python runs once more), steps 2-3 replays
    assert [c[0] for c in fwd.calls] == [3, 3]
    assert run.replays == 3 and len(FakeGraph.made) == 1
    graph, inputs, logits = run.graphs[(3,)]
    assert graph.ended and graph.replays == 3
    assert inputs[0].tolist() == [30, 31, 32]  # step 3's tokens copied into the graph's buffer
    assert out[3] is logits
    # a prefill (more tokens than requests) runs eagerly, and so does a new batch size
    tokens, batch, last, _ = _decode(2, 9)
    run.step(torch.arange(5), batch, last, 1)
    run.step(*_decode(2, 10))
    assert [c[0] for c in fwd.calls[2:]] == [2, 2] and run.replays == 3
    run.step(*_decode(2, 11))  # the second of size 2: captured in the first graph's pool
    assert len(FakeGraph.made) == 2 and FakeGraph.made[1].pool_in == FakeGraph.made[0].pool()


def test_each_graph_key_of_a_batch_size_gets_its_own_graph(fake_cuda):
    # hybrid residency: 3 requests split 3 resident / 0 spilled, then 2 / 1
    fwd, store = Forward(), Store()
    run = graphs.DecodeGraphs(fwd, store=store)
    store.key = (3, 0, 0)
    for s in range(3):
        run.step(*_decode(3, s))
    store.key = (2, 1, 1)
    run.step(*_decode(3, 3))  # a new split: eager first, though the size was captured
    assert len(fwd.calls) == 3 and len(FakeGraph.made) == 1
    run.step(*_decode(3, 4))
    store.key = (3, 0, 0)
    run.step(*_decode(3, 5))  # the first split's graph again
    assert sorted(run.graphs) == [(3, 2, 1, 1), (3, 3, 0, 0)]
    assert run.graphs[(3, 3, 0, 0)][0].replays == 3 and run.replays == 4


def test_a_step_that_cannot_be_captured_fails_in_one_line(fake_cuda):
    run = graphs.DecodeGraphs(Forward(fail=True), store=Store())
    run.step(*_decode(2, 0))
    with pytest.raises(RuntimeError, match=r"could not be captured .*graphs=False"):
        run.step(*_decode(2, 1))
    assert FakeGraph.made[0].ended  # the capture was ended, not left open


def test_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        graphs.DecodeGraphs(SimpleNamespace(device=torch.device("cpu")), store=None)
