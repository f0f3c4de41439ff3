"""Schemas mark mutated arguments, fake kernels let the ops trace, missing backends explain."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hisparse.ops import calls  # noqa: F401  (registers the fakes)
from hisparse.ops import extension as _ext
from tests.helpers import new_plan, new_state


def _resolve_args(device="cpu"):
    slot_keys, lru, stats = new_state(2, 8, device)
    out, src, dst, count = new_plan(2, 4, device)
    top_k = torch.tensor([[1, 2, 3, 3], [4, 5, -1, 6]], dtype=torch.int32, device=device)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=device)
    return (top_k, rows, None, slot_keys, lru, stats, out, src, dst, count, 100, 0)


def test_schemas_mark_mutated_arguments():
    schema = torch.ops.hisparse.hisparse_resolve_residency.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert mutated == [
        "slot_keys",
        "lru",
        "stats",
        "out_rows",
        "miss_src",
        "miss_dst",
        "miss_count",
    ]
    schema = torch.ops.hisparse.hisparse_gather.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == [
        "hot",
        "moved_bytes",
    ]
    schema = torch.ops.hisparse.hisparse_invalidate.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == [
        "slot_keys",
        "lru",
    ]


# torch.library.opcheck on both backends (the `device` fixture): the schema's mutation marks
# hold for what the kernel really writes, and the fake kernel agrees with the real one.
OPCHECK_UTILS = ["test_schema", "test_faketensor"]


@pytest.mark.parametrize("test_utils", OPCHECK_UTILS)
def test_opcheck_resolve(device, test_utils):
    torch.library.opcheck(
        torch.ops.hisparse.hisparse_resolve_residency.default,
        _resolve_args(device),
        test_utils=test_utils,
    )


@pytest.mark.parametrize("test_utils", OPCHECK_UTILS)
def test_opcheck_gather_and_invalidate(device, test_utils):
    d = device
    # opcheck runs the op on deep copies, and a copy of a pinned tensor is pageable, which the
    # CUDA backend refuses: on CUDA the host views live on the device (which it also takes)
    hosts = [torch.randint(0, 255, (4, 2, 32), dtype=torch.uint8).to(d)]
    hot = [torch.zeros(16, 32, dtype=torch.uint8, device=d)]
    src = torch.tensor([[1, 2]], dtype=torch.int32, device=d)
    dst = torch.tensor([[3, 4]], dtype=torch.int32, device=d)
    count = torch.tensor([2], dtype=torch.int32, device=d)
    torch.library.opcheck(
        torch.ops.hisparse.hisparse_gather.default,
        (hosts, hot, src, dst, count, None),
        test_utils=test_utils,
    )
    slot_keys, lru, _ = new_state(2, 8, d)
    torch.library.opcheck(
        torch.ops.hisparse.hisparse_invalidate.default,
        (
            slot_keys,
            lru,
            torch.tensor([1], dtype=torch.int32, device=d),
            torch.tensor([3], dtype=torch.int32, device=d),
        ),
        test_utils=test_utils,
    )


def test_resolve_traces_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _resolve_args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        torch.ops.hisparse.hisparse_resolve_residency(*fake)


def test_missing_backend_error_says_how_to_build():
    with pytest.raises(_ext.BackendUnavailableError, match="pip install --no-build-isolation"):
        _ext.require("xpu")


def test_import_survives_missing_extension(tmp_path):
    """A package without hisparse._C imports fine and fails only at the op call, clearly."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'hisparse._C': raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, hisparse, hisparse.ops as o\n"
        "try:\n"
        "    o.invalidate(torch.zeros(1, 1, dtype=torch.int32),"
        " torch.zeros(1, 1, dtype=torch.int16), torch.zeros(1, dtype=torch.int32))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "BackendUnavailableError" in out.stdout and "not built" in out.stdout


def test_cuda_call_without_cuda_backend_is_explained():
    if "cuda" in _ext.built_backends():
        pytest.skip("CUDA backend is built here")
    with pytest.raises(_ext.BackendUnavailableError, match="without its CUDA backend"):
        _ext.require("cuda")


def test_info_command_lists_backends():
    out = subprocess.run(
        [sys.executable, "-m", "hisparse", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert "backends built" in out and "cpu" in out and torch.__version__ in out
