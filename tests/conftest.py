"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os

import pytest

# Bit-exact comparisons across CUDA streams need cuBLAS's fixed-workspace mode, set before any
# cuBLAS handle exists (see benchmarks/bench_decode_tpot.py).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from tests.devices import DEVICES


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The op backend a test runs on: "cpu", and "cuda" (marked `cuda`; skipped without a GPU
    or without the CUDA build of hisparse._C). Write a behaviour once against `device`."""
    return request.param
