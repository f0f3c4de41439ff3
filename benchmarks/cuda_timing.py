"""What the kernel benches share: timing one GPU launch (or a short sequence) by CUDA events,
writing their rows as JSON, and building an experiment's CUDA source on first use."""

from __future__ import annotations

import functools
import json
import statistics

import torch


def median_us(fn, reps: int) -> float:
    """Median over `reps` calls of `fn` (after one warm call) of the GPU time between events
    recorded around it, in us. The calls are queued back to back, with no sync between them."""
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(reps)]
    fn()
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def write_rows(path, rows: list, **meta) -> None:
    """``{"device": ..., **meta, "rows": rows}`` to ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), **meta, rows=rows), f, indent=1)


@functools.cache
def sm90a_module(name: str, declaration: str, source: str):
    """``source`` built for sm_90a (Hopper-only instructions) by torch's inline extension loader
    on first use; ``declaration`` is the C++ prototype of the one function it exports."""
    from torch.utils.cpp_extension import load_inline

    function = declaration.split("(")[0].split()[-1]
    return load_inline(
        name,
        cpp_sources=declaration,
        cuda_sources=source,
        functions=[function],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
    )
