"""A small DSA-engine workload as `demo` / `bench` flags, for fast CPU tests: five requests
through a batch of three (connector state rows reused), contexts several times the hot buffer,
on the generated two-layer GLM-5 checkpoint (one index group)."""

from __future__ import annotations

SMALL_FLAGS = [
    "--requests",
    "5",
    "--concurrency",
    "3",
    "--prompt-len",
    "72",
    "--output-len",
    "10",
    "--layers",
    "2",
    "--top-k",
    "16",
]
DEMO_FLAGS = [*SMALL_FLAGS, "--hot-size", "32", "--no-progress"]
