"""Runtime on CUDA: pinned host pool, copy stream, per-layer readiness, graph capture of a whole
step; everything must equal the CPU runtime bit for bit."""

from __future__ import annotations

import pytest
import torch

from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime
from hisparse.runtime.host_pool import HostPool
from hisparse.runtime.views import PackedLayout, bind_layers
from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]

S, H, K, B, L, RB, BLOCK = 8, 256, 128, 6, 4, 656, 64
NUM_KEYS = 4096


def build(device, pool_bytes_src):
    layout = PackedLayout(
        tuple(f"l{i}" for i in range(L)),
        num_blocks=NUM_KEYS // BLOCK,
        block_size=BLOCK,
        row_bytes=RB,
        offset=256,
    )
    pool = HostPool(layout.nbytes(), pin=(device == "cuda"))
    pool.raw.copy_(pool_bytes_src[: layout.nbytes()])
    hosts = bind_layers(pool.raw, layout)
    g = HiSparseIndexGroup(
        "g",
        num_state_rows=S,
        hot_size=H,
        top_k=K,
        max_batch=B,
        num_keys=NUM_KEYS,
        device=device,
        hot_base=BLOCK,
    )
    hots = torch.zeros(L, BLOCK + S * H, RB, dtype=torch.uint8, device=device)
    rts = [HiSparseRuntime(n, g, v, hots[i]) for i, (n, v) in enumerate(hosts.items())]
    return pool, g, rts, hots


def workload(steps, seed):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randint(0, NUM_KEYS - 600, (S,), generator=gen)
    out = []
    for _ in range(steps):
        rows = torch.randperm(S, generator=gen)[:B].to(torch.int32)
        rows[-1] = -1  # a CUDA-graph padding row
        keys = centers[rows.clamp(min=0).long()].unsqueeze(1) + torch.randint(
            0, 500, (B, K), generator=gen
        )
        centers += torch.randint(0, 6, (S,), generator=gen)
        out.append((keys.to(torch.int32), rows))
    return out


def run_step(g, rts, keys, rows):
    out = rts[0].resolve(keys, rows)
    for rt in rts:
        rt.gather()
    for rt in rts:
        rt.wait_ready()
    return out


def test_cuda_runtime_equals_cpu_runtime():
    src = torch.randint(0, 256, (L * NUM_KEYS * RB + 4096,), dtype=torch.uint8)
    cpu = build("cpu", src)
    gpu = build("cuda", src)
    assert gpu[0].pinned and gpu[0].raw.is_pinned()
    for keys, rows in workload(30, 1):
        o_cpu = run_step(cpu[1], cpu[2], keys, rows)
        o_gpu = run_step(gpu[1], gpu[2], keys.cuda(), rows.cuda())
        torch.cuda.synchronize()
        assert torch.equal(o_cpu, o_gpu.cpu())
    assert torch.equal(cpu[1].slot_keys, gpu[1].slot_keys.cpu())
    assert torch.equal(cpu[1].lru, gpu[1].lru.cpu())
    assert cpu[1].counters.tolist() == gpu[1].counters.cpu().tolist()
    assert torch.equal(cpu[3], gpu[3].cpu())
    gpu[0].release()
    gpu[0].release()


def captured(step, inst, first):
    """``step(g, rts, keys, rows)`` of ``inst`` captured in a CUDA graph, after one real step
    (``first``) on a side stream as torch recommends: ``replay(keys, rows)`` -> its out rows."""
    keys_in = torch.zeros(B, K, dtype=torch.int32, device="cuda")
    rows_in = torch.zeros(B, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        keys_in.copy_(first[0])
        rows_in.copy_(first[1])
        step(inst[1], inst[2], keys_in, rows_in)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(inst[1], inst[2], keys_in, rows_in)

    def replay(keys, rows):
        keys_in.copy_(keys)
        rows_in.copy_(rows)
        graph.replay()
        return out

    return replay


def test_whole_step_captures_in_a_cuda_graph():
    src = torch.randint(0, 256, (L * NUM_KEYS * RB + 4096,), dtype=torch.uint8)
    eager = build("cuda", src)
    graphed = build("cuda", src)
    steps = workload(12, 2)
    replay = captured(run_step, graphed, steps[0])
    run_step(eager[1], eager[2], steps[0][0].cuda(), steps[0][1].cuda())
    for keys, rows in steps[1:]:
        out_g = replay(keys, rows)
        out_e = run_step(eager[1], eager[2], keys.cuda(), rows.cuda())
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e)
    assert torch.equal(graphed[1].slot_keys, eager[1].slot_keys)
    assert torch.equal(graphed[1].lru, eager[1].lru)
    assert graphed[1].counters.tolist() == eager[1].counters.tolist()
    assert torch.equal(graphed[3], eager[3])


def test_a_pinned_pool_dropped_without_release_is_unpinned():
    """A HostPool that goes out of scope without release() unpins its memory before freeing it:
    a freed range the driver still counts as registered makes copies from memory allocated
    there later fail ("invalid argument"). Same-size allocations usually land on the freed
    range, so they are copied to the device a few times."""
    import gc

    n = 64 << 20
    pool = HostPool(n, pin=True)
    ptr = pool.raw.data_ptr()
    del pool
    gc.collect()
    for _ in range(4):
        src = torch.ones(n, dtype=torch.uint8)
        reused = src.data_ptr() == ptr
        assert int(src.to("cuda").sum()) == n, f"copy failed (allocation reused the pool: {reused})"
