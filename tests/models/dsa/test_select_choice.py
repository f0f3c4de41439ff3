"""Which top-k ``kernels/select.top_k_slots`` runs: the extension's op for a decode batch whose
rows fit its shared memory, ``topk`` and the slots launch otherwise (the op itself is tested in
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
    "tokens,keys,takes_op",
    [
        (1, 32768, True),
        (select.OP_MAX_TOKENS, select.OP_MAX_KEYS, True),
        (select.OP_MAX_TOKENS + 1, 4096, False),  # a prefill chunk
        (1, select.OP_MAX_KEYS + 64, False),  # a row past the op's shared memory
    ],
)
def test_the_op_serves_decode_batches_of_rows_it_holds(op, tokens, keys, takes_op):
    scores = torch.zeros(tokens, keys)
    req = torch.zeros(tokens, dtype=torch.int64)
    bt = torch.zeros(1, keys // 64 + 1, dtype=torch.int32)
    got = select.top_k_slots(scores, req, bt, 64, 16)
    assert (op.calls == [(tokens, keys)]) is takes_op
    assert (got == "former path") is not takes_op


def test_no_op_on_the_cpu():
    assert select._op("cpu") is None
