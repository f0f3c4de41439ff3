"""The engine-side doors to a worker's host pool, as the DSA engine moves its own rows through
them (hisparse/engine/dsa: its stores' saves and prefill reads, hybrid's spills and returns):
rows saved with ``save_kv_layer`` land in the worker's own host views (the pool the connector
gathers from) at their keys and nowhere else, padding skipped; ``load_host_rows`` reads them back
bit for bit, through the facade as through the worker."""

from __future__ import annotations

import torch

from hisparse.connector import HiSparseConfig, HiSparseConnectorImpl

LAYERS = ("l0", "l1", "l2")
ROW_BYTES = 32
HOST_ROWS = 64


def _connector() -> HiSparseConnectorImpl:
    cfg = HiSparseConfig(top_k=4, hot_size=8, max_num_seqs=2, block_size=4)
    conn = HiSparseConnectorImpl(cfg, "worker")
    hot = {n: torch.zeros(16, ROW_BYTES, dtype=torch.uint8) for n in LAYERS}
    conn.worker.register_kv_caches(hot, host_rows=HOST_ROWS, groups=[list(LAYERS)])
    return conn


def _random_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, ROW_BYTES), generator=g, dtype=torch.int64).to(torch.uint8)


def test_saved_rows_land_in_the_workers_pool_and_load_back_bit_for_bit():
    conn = _connector()
    w = conn.worker
    keys = torch.tensor([7, 3, 40, 0, 11])
    rows = {n: _random_rows(5, seed) for seed, n in enumerate(LAYERS)}
    for n in LAYERS:  # every layer through the facade, as the DSA stores save
        conn.save_kv_layer(n, rows[n], None, slot_mapping=keys)
    for n in LAYERS:
        assert torch.equal(w.host_view(n)[keys], rows[n])  # the worker's own pool
        assert torch.equal(conn.load_host_rows(n, keys), rows[n])
        assert torch.equal(w.load_host_rows(n, keys.flip(0)), rows[n].flip(0))
    # -1 is padding: it reads row 0 (key 0 is the fourth row saved above)
    padded = conn.load_host_rows("l1", torch.tensor([11, -1]))
    assert torch.equal(padded, rows["l1"][[4, 3]])
    conn.shutdown()


def test_a_save_touches_only_its_rows_of_its_layer_and_skips_padding():
    conn = _connector()
    w = conn.worker
    # The pool is not zeroed (a row is read only after it is written), so "not touched" is
    # "unchanged": its bytes are whatever was there.
    before = {n: w.host_view(n).clone() for n in LAYERS}
    new = _random_rows(2, 9)
    w.save_kv_layer("l1", new, torch.tensor([9, -1]))
    after = {n: w.host_view(n) for n in LAYERS}
    assert torch.equal(after["l1"][9], new[0])
    assert torch.equal(after["l1"][:9], before["l1"][:9])
    assert torch.equal(after["l1"][10:], before["l1"][10:])
    assert torch.equal(after["l0"], before["l0"]) and torch.equal(after["l2"], before["l2"])
    conn.shutdown()
