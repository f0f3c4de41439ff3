"""Churn: >= 10^5 lookups through the runtime while requests come and go. Finished requests hand
their state rows and their host rows (blocks) to new requests, which write new bytes there;
live requests rewrite positions now and then. After every step, every selected entry of every
layer must read exactly the bytes the host pool holds now (the byte-level reference): a missed
reset or invalidation serves a stale row and fails here."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime, StateRowAllocator
from hisparse.runtime.views import PackedLayout, bind_layers

S, H, K = 6, 48, 32  # state rows, hot slots, top-k
BLOCK, BLOCKS = 8, 96  # host pool: 96 blocks of 8 rows = 768 keys
ROW_BYTES = (32, 64, 48)  # three member layers of one index group
MAX_BLOCKS_PER_REQ = 10
STEPS = 640
MIN_LOOKUPS = 100_000


class Pool:
    """The host pool and its byte-level truth: which request owns which block."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.layout = PackedLayout(
            tuple(f"l{i}" for i in range(len(ROW_BYTES))),
            num_blocks=BLOCKS,
            block_size=BLOCK,
            row_bytes=max(ROW_BYTES),
        )
        names = self.layout.layer_names
        raw = torch.zeros(self.layout.nbytes(), dtype=torch.uint8)
        full = bind_layers(raw, self.layout)
        # Narrower layers use a prefix of their rows: strided host views, as in a packed pool.
        self.views = {n: full[n][..., :rb] for n, rb in zip(names, ROW_BYTES)}
        self.free = list(range(BLOCKS))
        rng.shuffle(self.free)
        self.gen = torch.Generator().manual_seed(rng.randrange(2**31))

    def rows(self, name):
        return self.views[name].reshape(-1, self.views[name].shape[-1])

    def write(self, keys):
        """New content for these host rows in every layer (a fresh token, or a rewrite)."""
        idx = torch.tensor(keys, dtype=torch.int64)
        for v in self.views.values():
            flat = v.reshape(-1, v.shape[-1])
            flat[idx] = torch.randint(
                0, 256, (len(keys), v.shape[-1]), dtype=torch.uint8, generator=self.gen
            )


class Request:
    def __init__(self, rid, blocks, length):
        self.rid, self.blocks, self.length = rid, blocks, length
        self.prev = []

    def keys(self):
        ks = [b * BLOCK + j for b in self.blocks for j in range(BLOCK)]
        return ks[: self.length]


def _make_group(pool):
    g = HiSparseIndexGroup(
        "g",
        num_state_rows=S,
        hot_size=H,
        top_k=K,
        max_batch=S,
        num_keys=BLOCKS * BLOCK,
        device="cpu",
    )
    rts = [
        HiSparseRuntime(n, g, pool.views[n], torch.zeros(S * H, rb, dtype=torch.uint8))
        for n, rb in zip(pool.layout.layer_names, ROW_BYTES)
    ]
    return g, rts


def _churn(seed, steps, sabotage=None):
    rng = random.Random(seed)
    pool = Pool(rng)
    g, rts = _make_group(pool)
    if sabotage is not None:
        setattr(g, sabotage, lambda *a, **k: None)
    alloc = StateRowAllocator(S)
    live: dict = {}
    next_id = lookups = distinct_total = reused_rows = rewrites = 0
    seen_rows = set()
    for step in range(steps):
        # Finish some requests: their state rows and blocks go back for reuse.
        for rid in [r for r in live if rng.random() < 0.06]:
            req = live.pop(rid)
            g.release([alloc.free(rid)])
            pool.free.extend(req.blocks)
        # Admit new requests into free state rows, on recycled blocks with new bytes.
        while len(live) < S and rng.random() < 0.7:
            n_blocks = rng.randint(K // BLOCK, MAX_BLOCKS_PER_REQ)
            if len(pool.free) < n_blocks:
                break
            rid = f"r{next_id}"
            next_id += 1
            row = alloc.allocate(rid)
            reused_rows += row in seen_rows
            seen_rows.add(row)
            req = Request(
                rid, [pool.free.pop(0) for _ in range(n_blocks)], rng.randint(K, n_blocks * BLOCK)
            )
            pool.write(req.keys())
            live[rid] = req
        if not live:
            continue
        order = sorted(live, key=lambda r: alloc.row_of(r))
        # Rewrites: a position of a live request gets new bytes; its hot copy must go.
        inval_rows, inval_keys = [], []
        for rid in order:
            if rng.random() < 0.1:
                key = rng.choice(live[rid].keys())
                pool.write([key])
                inval_rows.append(alloc.row_of(rid))
                inval_keys.append(key)
        if inval_rows:
            g.invalidate_keys(inval_rows, inval_keys)
            rewrites += len(inval_rows)
        # Top-k with locality: most of last step's selection, the rest fresh; -1 pads.
        top = []
        for rid in order:
            req = live[rid]
            ks = req.keys()
            keep = [k for k in req.prev if rng.random() < 0.85]
            fresh = rng.sample(ks, min(len(ks), K))
            sel = list(dict.fromkeys(keep + fresh))[: K - rng.randint(0, 3)]
            req.prev = sel
            top.append(sel + [-1] * (K - len(sel)))
        top_k = torch.tensor(top, dtype=torch.int32)
        state_rows = torch.tensor([alloc.row_of(r) for r in order], dtype=torch.int32)
        out = rts[0].resolve(top_k, state_rows)
        for rt in rts:
            rt.gather()
        # The byte-level reference: each selected entry reads the host row's current bytes.
        mask = top_k >= 0
        keys, phys = top_k[mask].long(), out[mask].long()
        assert bool((phys >= 0).all()), f"step {step}: a selected key got no row"
        for rt in rts:
            got = rt.hot_view[phys]
            want = pool.rows(rt.layer_name)[keys]
            if not torch.equal(got, want):
                bad = (got != want).any(dim=1).nonzero()[0].item()
                raise AssertionError(
                    f"step {step}: layer {rt.layer_name} key {int(keys[bad])} "
                    f"served stale bytes from hot row {int(phys[bad])}"
                )
        lookups += int(mask.sum())
        distinct_total += sum(len({k for k in row if k >= 0}) for row in top)
    return g, lookups, distinct_total, reused_rows, rewrites


def test_churn_reads_only_current_bytes():
    g, lookups, distinct_total, reused_rows, rewrites = _churn(2024, STEPS)
    hits, misses, moved = (int(x) for x in g.counters.tolist())
    assert lookups >= MIN_LOOKUPS, lookups
    assert reused_rows > 50 and rewrites > 200, (reused_rows, rewrites)
    assert hits + misses == distinct_total and hits > misses > 0
    assert moved == misses * sum(ROW_BYTES)


@pytest.mark.parametrize("sabotage", ["release", "invalidate_keys"])
def test_churn_catches_a_skipped_reset_or_invalidation(sabotage):
    """The reference is sharp: without either step a stale row is served within the run."""
    with pytest.raises(AssertionError, match="served stale bytes"):
        _churn(2024, STEPS, sabotage=sabotage)
