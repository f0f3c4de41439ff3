"""Which op backends this machine can run, and the marks that say so.

`DEVICES` are the params of the `device` fixture (tests/conftest.py): a behaviour written once
runs on the C++ CPU backend and on the CUDA backend. The cuda param carries `pytest.mark.cuda`
(so `pytest -m cuda` selects it) and skips cleanly without a GPU or without the CUDA build of
hisparse._C.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.ops import extension as _ext


def cuda_ready() -> bool:
    """A CUDA device is visible and hisparse._C was built with its CUDA backend."""
    try:
        return torch.cuda.is_available() and "cuda" in _ext.built_backends()
    except Exception:  # pragma: no cover - a broken CUDA runtime counts as "not available"
        return False


CUDA_REASON = "needs a CUDA device and the CUDA build of hisparse._C"

# For tests that only make sense on a GPU: mark them `cuda` too (pytest.mark.cuda).
needs_cuda = pytest.mark.skipif(not cuda_ready(), reason=CUDA_REASON)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, needs_cuda]),
]


def host_side(t: torch.Tensor, device: str) -> torch.Tensor:
    """A host-side tensor as the op on `device` takes it: page-locked for the CUDA backend
    (which refuses pageable host memory), as is for the CPU backend."""
    return t.pin_memory() if device != "cpu" else t
