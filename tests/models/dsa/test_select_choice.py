"""Which top-k ``kernels/select.top_k_slots`` runs: the extension's op wherever it is built for
the scores' device, ``topk`` and the slots launch otherwise (the op itself is tested in
tests/ops/test_topk_slots.py, the two paths against each other on a GPU in test_core_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa.kernels import select


class _Op:
    def __init__(self):
        self.calls = []

    def __call__(self, scores, req, block_table, block_size, out):
        self.calls.append(tuple(scores.shape))
        out.fill_(-1)


@pytest.fixture
def op(monkeypatch):
    fake = _Op()
    monkeypatch.setattr(select, "_op", lambda device_type: fake)
    monkeypatch.setattr(select, "selection_slots", lambda *a: "former path")
    return fake


@pytest.mark.parametrize(
    "tokens,keys",
    [(1, 32768), (112, 131072), (2048, 4096)],  # decode at 32k and 128k, a prefill chunk
)
def test_the_op_serves_every_step_where_it_is_built(op, tokens, keys):
    scores = torch.zeros(tokens, keys)
    req = torch.zeros(tokens, dtype=torch.int64)
    bt = torch.zeros(1, keys // 64 + 1, dtype=torch.int32)
    got = select.top_k_slots(scores, req, bt, 64, 16)
    assert op.calls == [(tokens, keys)]
    assert (got == -1).all()


def test_no_op_on_the_cpu():
    assert select._op("cpu") is None


def test_topk_and_the_slots_launch_without_the_op(monkeypatch):
    monkeypatch.setattr(select, "_op", lambda device_type: None)
    monkeypatch.setattr(select, "selection_slots", lambda *a: "former path")
    scores = torch.zeros(2, 4096)
    bt = torch.zeros(1, 64, dtype=torch.int32)
    req = torch.zeros(2, dtype=torch.int64)
    assert select.top_k_slots(scores, req, bt, 64, 16) == "former path"
