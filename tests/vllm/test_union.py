"""Decodes of several query tokens (speculative decoding) resolved as one union row per request
(``hisparse.models.dsa.union``) through a CPU connector worker whose index group is
``decode_tokens`` x ``top_k`` wide: every token attends over exactly the bytes a resident read
of its own keys gives, and the same bytes a resolve of each token on its own gives; a key two
tokens of one request share is resolved and counted once; the next step finds the keys hot."""

from __future__ import annotations

import pytest
import torch

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.worker import HiSparseConnectorMetadata, HiSparseConnectorWorker
from hisparse.models.dsa.union import decode_token_rows, token_ids, union_rows

K, RB, ROWS, LAYER = 8, 32, 96, "layer0"


def _worker(q: int, seqs: int, hot_size=None) -> HiSparseConnectorWorker:
    cfg = HiSparseConfig(
        top_k=K, decode_tokens=q, hot_size=hot_size, max_num_seqs=seqs, block_size=4
    )
    w = HiSparseConnectorWorker(cfg)
    hot = torch.zeros(seqs * cfg.hot_size, RB, dtype=torch.uint8)
    w.register_kv_caches({LAYER: hot}, host_rows=ROWS)
    rows = torch.randint(0, 256, (ROWS, RB), dtype=torch.uint8, generator=_gen(1))
    w.save_kv_layer(LAYER, rows, torch.arange(ROWS))
    return w


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(q_lens, seed: int):
    """vLLM's view of a decode batch: each token's batch row, the rows' first tokens, and each
    token's top-k keys (-1 padding; tokens of one request share some keys, as neighbours do)."""
    starts = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    req = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    g = _gen(seed)
    keys = []
    for n in q_lens:
        base = torch.randperm(ROWS, generator=g)[: K + 3]
        for j in range(n):
            k = base[j : j + K].clone()  # consecutive tokens overlap in K - 1 keys
            k[torch.rand(K, generator=g) < 0.2] = -1
            keys.append(k)
    return req, starts, torch.stack(keys)


def _step(w: HiSparseConnectorWorker, rows) -> None:
    ids = [f"r{i}" for i in range(len(rows))]
    w.start_step(HiSparseConnectorMetadata(req_ids=tuple(ids), state_rows=tuple(rows)))


def _union_ids(w, q, q_lens, keys, req, starts, state_rows):
    at = decode_token_rows(req, starts, q)
    top = union_rows(keys, at, len(q_lens), q)
    assert top.shape == (len(q_lens), q * K) and top.dtype == torch.int32
    out = w.resolve(LAYER, top, state_rows=torch.tensor(state_rows, dtype=torch.int32))
    return top, at, token_ids(out, at, q)


def _read(w, ids):
    """The attended rows' bytes; a padding entry (-1) reads as zeros."""
    got = w.hot_view(LAYER)[ids.long().clamp(min=0)]
    return torch.where((ids >= 0)[..., None], got, torch.zeros_like(got))


@pytest.mark.parametrize("q,q_lens", [(2, [2, 1, 2, 2]), (3, [3, 1, 2, 3, 3])])
def test_each_token_reads_its_own_keys_rows(q, q_lens):
    req, starts, keys = _batch(q_lens, seed=q)
    w = _worker(q, seqs=len(q_lens))
    state = list(range(len(q_lens)))[::-1]  # state rows in another order than the batch rows
    _step(w, state)
    top, at, ids = _union_ids(w, q, q_lens, keys, req, starts, state)

    # The union row: token j of request r in slice j, -1 where r has fewer tokens.
    t = 0
    for r, n in enumerate(q_lens):
        for j in range(q):
            want = keys[t + j] if j < n else torch.full((K,), -1)
            assert torch.equal(top[r, j * K : (j + 1) * K], want.to(torch.int32))
        t += n
    # A split that ignores the shorter requests would hand tokens another request's rows.
    naive = token_ids(torch.arange(top.numel()).view(top.shape), None, q).reshape(-1, K)
    assert not torch.equal(naive[: keys.shape[0]], token_ids(top, at, q))

    host = w.host_view(LAYER)
    resident = torch.where((keys >= 0)[..., None], host[keys.clamp(min=0)], 0)
    assert torch.equal(ids < 0, keys < 0)
    assert torch.equal(_read(w, ids), resident)

    # The same keys resolved one token per state row (no union) serve the same bytes.
    ref = _worker(1, seqs=keys.shape[0])
    _step(ref, list(range(keys.shape[0])))
    per_token = ref.resolve(LAYER, keys.to(torch.int32), state_rows=None)
    assert torch.equal(_read(ref, per_token), _read(w, ids))

    # Misses count each distinct key of a request once, however many of its tokens chose it.
    distinct = sum(
        len(set(keys[int(starts[r]) : int(starts[r + 1])].flatten().tolist()) - {-1})
        for r in range(len(q_lens))
    )
    hits, misses = (int(x) for x in w.groups[0].stats.tolist())
    assert (hits, misses) == (0, distinct)

    # The next step finds them hot: the same keys are all hits, nothing is copied.
    _step(w, state)
    _, _, again = _union_ids(w, q, q_lens, keys, req, starts, state)
    hits, misses = (int(x) for x in w.groups[0].stats.tolist())
    assert (hits, misses) == (distinct, distinct)
    assert torch.equal(_read(w, again), resident)


def test_a_shifted_step_reuses_the_overlap_and_copies_the_rest():
    q, q_lens = 2, [2, 2, 1]
    w = _worker(q, seqs=3)
    req, starts, keys = _batch(q_lens, seed=7)
    _step(w, [0, 1, 2])
    _union_ids(w, q, q_lens, keys, req, starts, [0, 1, 2])
    h0, m0 = (int(x) for x in w.groups[0].stats.tolist())
    _, _, keys2 = _batch(q_lens, seed=8)
    _step(w, [0, 1, 2])
    _, _, ids = _union_ids(w, q, q_lens, keys2, req, starts, [0, 1, 2])
    hits, misses = (int(x) for x in w.groups[0].stats.tolist())
    before = [set(keys[int(starts[r]) : int(starts[r + 1])].flatten().tolist()) for r in range(3)]
    now = [set(keys2[int(starts[r]) : int(starts[r + 1])].flatten().tolist()) for r in range(3)]
    assert hits - h0 == sum(len((a & b) - {-1}) for a, b in zip(before, now))
    assert misses - m0 == sum(len(b - a - {-1}) for a, b in zip(before, now))
    host = w.host_view(LAYER)
    assert torch.equal(_read(w, ids), torch.where((keys2 >= 0)[..., None], host[keys2.clamp(0)], 0))


def test_one_token_decodes_are_passed_through_unchanged():
    req, starts, keys = _batch([1, 1, 1], seed=3)
    assert decode_token_rows(req, starts, 1) is None
    top = union_rows(keys, None, 3, 1)
    assert torch.equal(top, keys.to(torch.int32))
    assert token_ids(top, None, 1) is top
