import torch, exp_gather_pools as e
B, m = 112, 95
g = torch.Generator().manual_seed(0)
hot = torch.zeros(B * 4096, e.ROW, dtype=torch.uint8, device="cuda")
big = torch.empty(8 * B * (32768 + 64), e.ROW, dtype=torch.uint8, pin_memory=True)
nb = B * m * e.ROW
for L in (8, 4):
    for gb in [1.2, 2.4, 4.8, 9.6, 19.3]:
        reg = int(gb * 1e9 / L / B / e.ROW)
        if reg > 32768 + 64:
            continue
        pl = e.plans(B, reg, 4096, m, 8, g)
        views = [big[l * B * reg:(l + 1) * B * reg] for l in range(L)]
        med, lo, hi = e.time_case(views, hot, pl, L, 15)
        print(f"{L} layers, range {gb:5.1f} GB: {med:6.1f} us/layer [{lo:.1f}, {hi:.1f}] {nb / med / 1e3:5.1f} GB/s", flush=True)
