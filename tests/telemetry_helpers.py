"""A tiny multi-step workload driven through the HiSparse connector exactly as an engine does,
with hit / miss / byte totals counted independently of the device counters."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, field

import torch

from hisparse.connector import StepSchedule
from tests.helpers import connector_impl

BASE_CFG = {
    "top_k": 4,
    "hot_size": 8,
    "max_num_seqs": 3,
    "metrics_interval": 3,
    "host_pool_gib": 0.0005,
    "block_size": 4,
    "index_share": 2,
}


def make_pair(extra=None, row_bytes=(32, 64, 48), rows=None, device_hooks=None):
    """A scheduler connector and a worker connector with registered caches (one per layer)."""
    cfg = dict(BASE_CFG, **(extra or {}))
    sched = connector_impl(cfg, role="scheduler")
    work = connector_impl(cfg, role="worker", device_hooks=device_hooks)
    S, H = cfg["max_num_seqs"], cfg["hot_size"]
    n_rows = rows if rows is not None else S * H
    caches = {
        f"model.layers.{i}.attn": torch.zeros(n_rows, rb, dtype=torch.uint8)
        for i, rb in enumerate(row_bytes)
    }
    work.register_kv_caches(caches)
    return sched, work, caches


@dataclass
class Truth:
    hits: int = 0
    misses: int = 0
    bytes: int = 0
    steps: int = 0
    deltas: list = field(default_factory=list)


class Workload:
    """Requests arrive and finish; each step every layer saves its new row, the leaders resolve a
    top-k that mostly repeats the previous step's (locality), every layer waits for its load."""

    def __init__(self, sched, work, caches, seed=0, row_keys_per_req=64):
        self.sched, self.work, self.caches = sched, work, caches
        self.rng = random.Random(seed)
        self.cfg = work.config
        self.truth = Truth()
        self.live = {}  # req_id -> list of its keys (host rows)
        self.next_req = 0
        self.span = row_keys_per_req
        self.finished = set()

    def _new_request(self):
        rid = f"req-{self.next_req}"
        base = (self.next_req % 8) * self.span  # disjoint key ranges per live request slot
        self.next_req += 1
        self.live[rid] = {"base": base, "len": 0, "prev": []}
        return rid

    def step(self):
        w = self.work.worker
        K = self.cfg.top_k
        if len(self.live) < self.cfg.max_num_seqs and self.rng.random() < 0.5:
            self._new_request()
        if self.live and self.rng.random() < 0.15:
            rid = self.rng.choice(sorted(self.live))
            self.sched.request_finished(type("R", (), {"request_id": rid})(), [])
            del self.live[rid]
            self.finished.add(rid)
        order = sorted(self.live)
        so = StepSchedule({rid: 1 for rid in order})
        meta = self.sched.build_connector_meta(so)
        meta = pickle.loads(pickle.dumps(meta))  # crosses a process boundary in vLLM
        self.work.bind_connector_metadata(meta)
        self.work.start_load_kv(None)
        if order:
            # New KV rows of this step, one per request, written to every layer.
            slots = []
            for rid in order:
                st = self.live[rid]
                slots.append(st["base"] + st["len"] % self.span)
                st["len"] += 1
            for name in self.caches:
                rb = w.runtime(name).row_bytes
                rows = torch.tensor(
                    [[(s * 7 + j) % 251 for j in range(rb)] for s in slots], dtype=torch.uint8
                )
                self.work.save_kv_layer(name, rows, None, slot_mapping=slots)
            top = []
            for rid in order:
                st = self.live[rid]
                avail = list(range(st["base"], st["base"] + min(st["len"], self.span)))
                keep = [k for k in st["prev"] if k in avail and self.rng.random() < 0.8]
                pool = [k for k in avail if k not in keep]
                self.rng.shuffle(pool)
                sel = (keep + pool)[:K]
                st["prev"] = sel
                sel = sel + [-1] * (K - len(sel))
                top.append(sel)
            top_k = torch.tensor(top, dtype=torch.int32)
            for name in self.caches:
                rt = w.runtime(name)
                out = self.work.resolve(name, top_k)
                if rt.is_leader:
                    g = rt.index_group
                    n_miss = int(g.miss_count[: len(order)].sum())
                    distinct = sum(len({k for k in row if k >= 0}) for row in top)
                    self.truth.misses += n_miss
                    self.truth.hits += distinct - n_miss
                    self.truth.bytes += n_miss * sum(m.row_bytes for m in g.members)
                self.work.wait_for_layer_load(name)
                # Attention reads exactly the host rows it selected.
                hot = w.hot_view(name)
                for b, row in enumerate(top):
                    for i, key in enumerate(row):
                        if key >= 0:
                            assert torch.equal(hot[int(out[b, i])], w.host_view(name)[key])
        self.work.wait_for_save()
        self.work.clear_connector_metadata()
        self.truth.steps += 1
        stats = self.work.get_kv_connector_stats()
        if stats is not None:
            self.truth.deltas.append(stats.totals())
        return stats
