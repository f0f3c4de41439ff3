"""One TP rank of the CUDA shared-pool test (``test_device_fence_cuda``), run as a child process:
``python -m tests.runtime.fence_ranks RANK DIR MODE [STEPS]``; two of them share one GPU.

Rank 0 creates and pins the shared segment, rank 1 attaches and pins it (they meet through files
in DIR). Every step rank 0 writes each layer's rows, whose bytes depend on the step, into the
pool with the save op and flags them; rank 1 waits for the flag, gathers the rows into its GPU
and counts the bytes that differ from what rank 0 wrote this step. Both capture the step in a
CUDA graph and replay it. Rank 0 sleeps on the GPU before its writes and rank 1 after its reads,
so each side really waits for the other. MODE:

* ``graph``: STEPS replays; rank 1 prints ``mismatched bytes: N`` and rank 0 ``steps: N``;
* ``nofence``: the same, with rank 1's waits left out (the control: it must see mismatches);
* ``loop``: replays until killed, printing ``replaying`` once (for the fault tests); a failed
  wait traps, and the watchdog makes the rank leave with exit 70 and one line, as a vLLM
  worker does (the loop only waits for it).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from pathlib import Path

import torch

from hisparse import ops
from hisparse.connector import tp_pool
from hisparse.runtime.device_fence import DeviceFence
from hisparse.runtime.pool_fence import PoolFence, control_bytes
from hisparse.runtime.shared_pool import SharedHostPool

LAYERS, ROWS, ROW = 2, 512, 656
WARMUP = 2
SLEEP_CYCLES = 2_000_000  # about 1 ms on an H200
WHAT = "fence test pool"


def _meet(rank: int, where: Path):
    """Rank 0 creates the segment and its fence (the header a reader checks), then publishes it;
    rank 1 attaches; both pin it. As ``tp_pool`` does over a TP group, through files here."""
    info_file, joined = where / "info.pkl", where / "joined"
    timeout = float(os.environ.get("FENCE_TIMEOUT_S", "60"))
    if rank == 0:
        pool = SharedHostPool.create(LAYERS * ROWS * ROW, control_bytes(2, LAYERS), what=WHAT)
        fence = PoolFence(pool.control, 0, 2, LAYERS, timeout, pool_bytes=pool.num_bytes)
        tmp = where / "info.tmp"
        tmp.write_bytes(pickle.dumps(pool.info))
        tmp.rename(info_file)
        _until(joined.exists)
        pool.close_fd()
    else:
        _until(info_file.exists)
        pool = SharedHostPool.attach(pickle.loads(info_file.read_bytes()), what=WHAT)
        fence = PoolFence(pool.control, 1, 2, LAYERS, timeout, pool_bytes=pool.num_bytes)
        joined.touch()
    pool.pin(what=WHAT)
    dev = DeviceFence(
        fence, pool.control_address, torch.device("cuda"), on_fault=tp_pool._leave_with
    )
    dev.start()
    return pool, dev


def _until(ready, limit: float = 60.0) -> None:
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > limit:
            raise SystemExit("the other rank did not show up")
        time.sleep(0.01)


def _expected(layer: int, step: torch.Tensor) -> torch.Tensor:
    """The bytes rank 0 writes for ``layer`` at ``step`` (a device int64 [1]): new every step."""
    i = torch.arange(ROWS * ROW, device=step.device, dtype=torch.int64)
    return ((i * (layer + 3) + step * 7 + (i >> 9)) % 251).to(torch.uint8).view(ROWS, ROW)


def main() -> None:
    rank, where, mode = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 50
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    torch.cuda.set_device(0)
    pool, dev = _meet(rank, where)
    host = [pool.raw[i * ROWS * ROW : (i + 1) * ROWS * ROW].view(ROWS, ROW) for i in range(LAYERS)]
    cuda = torch.device("cuda")
    keys = torch.arange(ROWS, dtype=torch.int32, device=cuda)
    got = [torch.zeros(ROWS, ROW, dtype=torch.uint8, device=cuda) for _ in range(LAYERS)]
    count = torch.full((1,), ROWS, dtype=torch.int32, device=cuda)
    bad = torch.zeros((), dtype=torch.int64, device=cuda)

    def step() -> None:
        dev.begin_step()
        if rank == 0:
            torch.cuda._sleep(SLEEP_CYCLES)  # late writes: the reader must wait for them
            for layer in range(LAYERS):
                rows = _expected(layer, dev.step_counter)
                ops.save_rows([rows], [host[layer]], keys, keys, None)
                dev.layer_written(layer)
            return
        for layer in range(LAYERS):
            if mode != "nofence":
                dev.wait_layer(layer)
            ops.gather([host[layer]], [got[layer]], keys.view(1, -1), keys.view(1, -1), count)
            bad.add_((got[layer] != _expected(layer, dev.step_counter)).sum())
        torch.cuda._sleep(SLEEP_CYCLES)  # a slow reader: the writer must wait before rewriting
        dev.end_step()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(WARMUP):
            step()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    if mode == "loop":
        print("replaying", flush=True)
        try:
            while True:
                graph.replay()
                torch.cuda.synchronize()
        except RuntimeError:  # a wait gave up and trapped: the watchdog reports it and exits
            time.sleep(30)
            raise
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    if rank == 1:
        print(f"mismatched bytes: {int(bad)}", flush=True)
    print(f"steps: {int(dev.step_counter)}", flush=True)
    dev.close()
    pool.release()


if __name__ == "__main__":
    main()
