"""The host->device rate `hisparse plan` assumes for one step's misses, by the pool the batch
fills and how its index groups are laid out (docs/plan.md, "Host->device rate")."""

from __future__ import annotations

import math
from typing import Sequence, Tuple

from hisparse.cli.capacity import GIB

# Gathers of 656-B rows over PCIe Gen5 x16, GB/s (low, high). A large pool is bound by the
# device's translation of host addresses, not by the link: one-layer index groups gather at a
# rate set by the host range one step's misses span (the pool the batch fills), flat up to about
# 4.8 GB and falling past it (docs/hardware.md; benchmarks/results/gather_pool_range.md, H200
# and H100, 112 x 95 rows per layer; host_pages.md at 32 GiB). Between two points each bound is
# interpolated in log(range); past the last it stays. Rows of an index group co-located in the
# host pool let one translation serve the group's layers.
GBPS_BY_RANGE = (
    (4.8e9, (44.5, 48.0)),  # sweeps 44.5-45.7 up to 4.8 GB; op table 48.0 (1 GiB, batch 256)
    (9.6e9, (38.2, 42.3)),  # H100 over 4 layers / H200 over 8
    (19.3e9, (27.3, 33.4)),  # H200, eight 2.4 GB layer regions / H100 range sweep
    (32 * GIB, (14.2, 17.8)),  # one request's 2048 misses; batch 256 @ 20 %
)
WINDOW_BYTES = GBPS_BY_RANGE[0][0]  # pools at most this big gather at the small-pool rate
GBPS_COLOCATED = (46.3, 49.4)  # 32 GiB pool, index groups of 4 co-located, same two plans
COLOCATED_MEASURED = 4  # groups of 2-3 were not measured: they get the one-layer rate


def range_gbps(pool_bytes: float) -> Tuple[float, float]:
    """(low, high) GB/s of one-layer index groups gathering from a pool of ``pool_bytes``."""
    (x0, r0), *rest = GBPS_BY_RANGE
    if pool_bytes <= x0:
        return r0
    for x1, r1 in rest:
        if pool_bytes <= x1:
            f = math.log(pool_bytes / x0) / math.log(x1 / x0)
            return tuple(round(a + f * (b - a), 4) for a, b in zip(r0, r1))
        x0, r0 = x1, r1
    return r0


def _rate(size: int, pool_bytes: float) -> Tuple[float, float]:
    if size >= COLOCATED_MEASURED and pool_bytes > WINDOW_BYTES:
        return GBPS_COLOCATED
    return range_gbps(pool_bytes)


def gather_gbps(group_sizes: Sequence[int], pool_bytes: float) -> Tuple[float, float, str]:
    """(low, high, layout): the effective rate of one step's copies, each group's bytes (in
    proportion to its layers) at its own rate."""
    total = sum(group_sizes)
    rates = [(s, _rate(s, pool_bytes)) for s in group_sizes]
    lo = round(total / sum(s / r[0] for s, r in rates), 4)  # rounding: 14.2, not 14.1999...
    hi = round(total / sum(s / r[1] for s, r in rates), 4)
    sizes = "/".join(map(str, sorted(set(group_sizes))))
    kind = "one-layer index groups" if sizes == "1" else f"co-located {sizes}-layer index groups"
    where = f"a pool of {pool_bytes / GIB:.1f} GiB"
    if pool_bytes <= WINDOW_BYTES:
        where = f"a pool of at most {WINDOW_BYTES / GIB:.1f} GiB"
    elif pool_bytes >= GBPS_BY_RANGE[-1][0]:
        where = "a large pool"
    return lo, hi, f"{kind} from {where}"
