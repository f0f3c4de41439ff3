"""A small representative CUDA workload for compute-sanitizer (not a pytest module).

    compute-sanitizer --tool memcheck  python tests/cuda_sanitizer_workload.py --fallback
    compute-sanitizer --tool racecheck python tests/cuda_sanitizer_workload.py

Runs resolve (resident tier on and off, padding rows and entries, duplicate state rows,
out-of-range keys, a corrupted LRU; a batch small enough for the wide one-CTA-per-SM kernel and
one larger than the SM count), gather for a 2-layer index group from pinned host memory (bad
plan entries included), save_rows of the hot rows back to a pinned host copy, and invalidate in
both modes, and checks every result against the CPU backend so a silent wrong answer also
fails. `--fallback` adds the global-workspace resolve path (K = H = 9000), which is too slow
under racecheck and has no shared-memory scratch anyway.
"""

from __future__ import annotations

import argparse
import sys

import torch

from hisparse import ops


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fallback", action="store_true", help="also run the global-workspace path")
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [(6, 256, 512, 8), (3, 64, 64, 3), (sms + 8, 32, 64, sms + 10)]
    if args.fallback:
        configs.append((2, 9000, 9000, 2))
    failures = 0
    for B, K, H, S in configs:
        num_keys, L, row_bytes = 4 * H, 2, 656
        host_raw = torch.randint(
            0, 256, (num_keys, L, row_bytes), generator=g, dtype=torch.uint8
        ).pin_memory()
        host = [host_raw[:, l] for l in range(L)]
        hot_rows = S * H
        state = {
            d: dict(
                sk=torch.full((S, H), -1, dtype=torch.int32, device=d),
                lru=torch.arange(H, dtype=torch.int16, device=d).repeat(S, 1),
                stats=torch.zeros(2, dtype=torch.uint64, device=d),
                moved=torch.zeros(1, dtype=torch.uint64, device=d),
                saved=torch.zeros(1, dtype=torch.uint64, device=d),
                back=host_raw.clone().pin_memory() if d != "cpu" else host_raw.clone(),
                hot=[
                    torch.zeros(hot_rows, row_bytes, dtype=torch.uint8, device=d) for _ in range(L)
                ],
            )
            for d in ("cpu", dev)
        }
        for step in range(4):
            top_k = torch.randint(-2, num_keys + 3, (B, K), generator=g, dtype=torch.int64)
            top_k = top_k.to(torch.int32)
            top_k[:, K // 2 :] = top_k[:, : K - K // 2]  # duplicates
            rows = torch.randperm(S, generator=g)[:B].to(torch.int32)
            rows[-1] = rows[0] if B > 2 else -1  # duplicate state row / padding row
            resident = None
            if step % 2:
                resident = torch.where(
                    torch.rand(B, K, generator=g) < 0.1,
                    torch.randint(0, 1000, (B, K), generator=g),
                    torch.full((B, K), -1),
                ).to(torch.int32)
            if step == 3:  # a corrupted LRU entry must stay memory-safe
                for d in state:
                    state[d]["lru"][rows[0].item(), 0] = 30000
            res = {}
            for d, st in state.items():
                out = torch.full((B, K), -7, dtype=torch.int32, device=d)
                src, dst = out.clone(), out.clone()
                cnt = torch.full((B,), -7, dtype=torch.int32, device=d)
                ops.resolve_residency(
                    top_k.to(d),
                    rows.to(d),
                    st["sk"],
                    st["lru"],
                    st["stats"],
                    out,
                    src,
                    dst,
                    cnt,
                    num_keys=num_keys,
                    hot_base=0,
                    resident_rows=None if resident is None else resident.to(d),
                )
                dst[0, 0] = hot_rows + 3  # an out-of-range destination is skipped
                ops.gather(host, st["hot"], src, dst, cnt, st["moved"])
                # write the first rows of each hot view back to the host copy (bad rows too)
                n = min(40, hot_rows)
                h_rows = torch.arange(n, dtype=torch.int32, device=d) * 3 - 2
                s_rows = torch.arange(n, dtype=torch.int32, device=d)
                s_rows[1] = hot_rows + 1
                ops.save_rows(
                    st["hot"], [st["back"][:, l] for l in range(L)], s_rows, h_rows, st["saved"]
                )
                drop = torch.tensor([rows[0].item(), -1, S + 1], dtype=torch.int32, device=d)
                keys = torch.tensor([int(top_k[0, 1]), 5, 6], dtype=torch.int32, device=d)
                ops.invalidate(st["sk"], st["lru"], drop, keys)
                if step == 2:
                    ops.invalidate(st["sk"], st["lru"], drop[:2].clone())
                res[d] = (out, src, dst, cnt)
            torch.cuda.synchronize()
            for name, a, b in zip(("out", "src", "dst", "cnt"), res["cpu"], res[dev]):
                if not torch.equal(a, b.cpu()):
                    print(f"MISMATCH B={B} K={K} H={H} step {step}: {name}")
                    failures += 1
            c, u = state["cpu"], state[dev]
            for name in ("sk", "lru"):
                if not torch.equal(c[name], u[name].cpu()):
                    print(f"MISMATCH B={B} K={K} H={H} step {step}: {name}")
                    failures += 1
            if not torch.equal(c["back"], u["back"]):
                print(f"MISMATCH B={B} K={K} H={H} step {step}: saved host rows")
                failures += 1
            for name in ("stats", "moved", "saved"):
                if c[name].tolist() != u[name].cpu().tolist():
                    print(f"MISMATCH B={B} K={K} H={H} step {step}: {name}")
                    failures += 1
            for l in range(L):
                if not torch.equal(c["hot"][l], u["hot"][l].cpu()):
                    print(f"MISMATCH B={B} K={K} H={H} step {step}: hot[{l}]")
                    failures += 1
    failures += topk_slots_workload(dev, g)
    print("sanitizer workload:", "OK" if failures == 0 else f"{failures} mismatches")
    return 0 if failures == 0 else 1


def topk_slots_workload(dev: str, g: torch.Generator) -> int:
    """topk_slots over a row kept in shared memory and a longer one read from global memory,
    with ties, -inf, NaN, rows inside a wider buffer and a token whose request is out of range."""
    failures = 0
    for T, L, k, width in [(3, 5000, 2048, 5000), (2, 70000, 2048, 70016), (4, 300, 512, 320)]:
        buf = torch.randint(-50, 50, (T, width), generator=g).float()
        scores = buf[:, :L]
        scores[0, :7] = float("-inf")
        scores[-1, 3] = float("nan")
        block_size = 64
        blocks = (L + block_size - 1) // block_size
        table = torch.randperm(4 * blocks, generator=g)[: 2 * blocks].view(2, blocks).int()
        req = torch.tensor([0, 1, 5, 1][:T], dtype=torch.int32)
        res = {}
        for d in ("cpu", dev):
            out = torch.full((T, k), -7, dtype=torch.int64, device=d)
            ops.topk_slots(buf.to(d)[:, :L], req.to(d), table.to(d), block_size, out)
            res[d] = out
        torch.cuda.synchronize()
        if not torch.equal(res["cpu"], res[dev].cpu()):
            print(f"MISMATCH topk_slots T={T} L={L} k={k}")
            failures += 1
    return failures


if __name__ == "__main__":
    sys.exit(main())
