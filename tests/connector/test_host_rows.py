"""connector/host_rows.py: the engine-side door to a worker's host pool. Rows saved through it
land in the worker's own host views (the pool the connector gathers from), loads read them back
bit for bit, and every move covers all layers at once."""

from __future__ import annotations

import torch

from hisparse.connector.host_rows import HostRows
from hisparse.engine import EngineConfig
from hisparse.engine.hostkv import open_connector
from hisparse.engine.kvstore import packed_rows

CFG = EngineConfig(num_layers=3, index_share=3, top_k=8, hot_size=16, max_running=2)


def _door():
    cpu = torch.device("cpu")
    raw, flat = packed_rows(CFG, 64 + 2 * CFG.hot_size, 1, cpu, None)
    _, worker = open_connector(CFG, 2, flat, 64)
    w = worker.worker
    return HostRows(w, CFG.layer_names()), w, flat


def _random_rows(flat, seed):
    g = torch.Generator().manual_seed(seed)
    for f in flat:
        f.copy_(torch.randint(0, 256, f.shape, generator=g, dtype=torch.int64).to(torch.uint8))


def test_save_then_load_round_trips_every_layer():
    door, w, flat = _door()
    assert door.pool_bytes == w.host_rows * CFG.row_bytes * CFG.num_layers
    _random_rows(flat, 1)
    before = [f[:5].clone() for f in flat]
    keys = torch.tensor([7, 3, 40, 0, 11], dtype=torch.int32)
    door.save(flat, torch.arange(5, dtype=torch.int32), keys)
    for l, n in enumerate(CFG.layer_names()):  # landed in the worker's own pool
        assert torch.equal(w.host_view(n)[keys.long()], before[l])
    for f in flat:
        f.zero_()
    door.load(flat, keys, torch.arange(10, 15, dtype=torch.int32))
    for l, f in enumerate(flat):
        assert torch.equal(f[10:15], before[l])


def test_save_layer_and_scatter_touch_only_their_rows():
    door, w, flat = _door()
    _random_rows(flat, 2)
    names = CFG.layer_names()
    # The pool is not zeroed (torch.empty: a row is read only after it is written), so "not
    # touched" is "unchanged": after other tests freed memory its bytes are whatever was there.
    others = [w.host_view(names[l])[9].clone() for l in (0, 2)]
    door.save_layer(
        1, flat[1], torch.tensor([4], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    )
    assert torch.equal(w.host_view(names[1])[9], flat[1][4])
    assert all(torch.equal(w.host_view(names[l])[9], o) for l, o in zip((0, 2), others))
    rows = [torch.full((2, CFG.row_bytes), l + 1, dtype=torch.uint8) for l in range(3)]
    door.scatter(torch.tensor([20, 21]), rows)
    for l, n in enumerate(names):
        assert (w.host_view(n)[20:22] == l + 1).all()
