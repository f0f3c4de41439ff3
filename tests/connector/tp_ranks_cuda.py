"""One TP rank of ``test_tp_pool_cuda``, run as a child process: ``python -m
tests.connector.tp_ranks_cuda RANK DIR``; two of them share one GPU and a gloo group (the TP
group vLLM would hand the connector).

Each builds a connector worker on CUDA over the group, so the ranks share one pinned host pool.
Every step rank 0 saves rows whose bytes name the step and layer (late: it sleeps on the GPU
first), rank 1 saves rows of 255 (which must never reach the pool), and both resolve the same
top-k and gather into their own hot rows. Each rank writes what it gathered, per step, to
``DIR/rank<R>.pt``, and the pool's kind to stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.worker import HiSparseConnectorMetadata, HiSparseConnectorWorker

S, H, K, ROW, HOST_ROWS, STEPS = 2, 16, 4, 64, 64, 10
NAMES = ("l0", "l1")


class Peers:
    """A gloo group as ``hisparse.connector.tp_pool`` takes it."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_agree(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())


def main() -> None:
    rank, where = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{where}/store", rank=rank, world_size=2)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    w = HiSparseConnectorWorker(
        HiSparseConfig(top_k=K, hot_size=H, max_num_seqs=S, block_size=4, host_pool_gib=0.001)
    )
    hot = {n: torch.zeros(S * H, ROW, dtype=torch.uint8, device=dev) for n in NAMES}
    w.register_kv_caches(hot, host_rows=HOST_ROWS, groups=[list(NAMES)], peers=Peers(rank, 2))
    print(f"pool: {type(w.host_pool).__name__} pinned={w.host_pool.pinned}", flush=True)
    meta = HiSparseConnectorMetadata(req_ids=("a",), state_rows=(0,))
    got = []
    for step in range(1, STEPS + 1):
        w.start_step(meta)
        slots = torch.arange(4 * (step - 1), 4 * step, device=dev)
        for li, name in enumerate(NAMES):
            if rank == 0:
                torch.cuda._sleep(1_000_000)
                rows = torch.full((4, ROW), 10 * step + li, dtype=torch.uint8, device=dev)
            else:
                rows = torch.full((4, ROW), 255, dtype=torch.uint8, device=dev)
            w.save_kv_layer(name, rows, slots)
        keys = [4 * step - 1, 4 * step - 2, max(0, 4 * step - 7), max(0, 4 * step - 13)]
        top = torch.tensor([keys], dtype=torch.int32, device=dev)
        at = w.resolve("l0", top).long()[0]
        at1 = w.resolve("l1", None).long()[0]
        for name in NAMES:  # the gathers run on the copy stream, as attention would wait
            w.wait_for_layer_load(name)
        got.append(torch.stack([w.hot_view("l0")[at], w.hot_view("l1")[at1]]).cpu())
        w.end_step()
    torch.save(torch.stack(got), where / f"rank{rank}.pt")
    w.shutdown()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
