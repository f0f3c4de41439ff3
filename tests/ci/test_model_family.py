"""The DeepSeek-V3.2 / GLM-5 family stands apart from the reference sparse-MLA model that still
lives beside it (docs/architecture.md, "What remains of the reference model, and why"): no
module of the DSA side imports the reference model's modules, at any level of a file; the
helpers both families use live in modules of their own; and the import-linter contract that
keeps it so in CI is in pyproject.toml."""

from __future__ import annotations

import ast

import pytest
import tomllib

from tests import REPO_ROOT

PKG = REPO_ROOT / "hisparse"
#: The reference model's modules.
REFERENCE = {
    "hisparse.models.reference",
    "hisparse.models.reference_config",
    "hisparse.models.checkpoint",
    "hisparse.vllm.model",
}
#: The DSA side: subpackages and the shared modules split out of the reference model's.
DSA_SIDE = ["models/dsa", "engine/dsa", "vllm/dsa"]
SHARED = [
    "models/checkpoint_files.py",
    "vllm/cache_layers.py",
    "vllm/step_metadata.py",
    "vllm/model_connector.py",
]


def _files() -> list:
    out = [p for d in DSA_SIDE for p in sorted((PKG / d).rglob("*.py"))]
    return out + [PKG / f for f in SHARED]


def _imports(path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(PKG)))
def test_dsa_side_imports_nothing_of_the_reference_model(path):
    assert sorted(_imports(path) & REFERENCE) == []


def test_the_shared_modules_exist_and_the_gone_one_stays_gone():
    assert all((PKG / f).is_file() for f in SHARED)
    # The reference model's vLLM layers moved: IndexerCache into vllm/model.py, the rest above.
    assert not (PKG / "vllm" / "layers.py").exists()


def test_the_contract_guards_the_same_modules():
    cfg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    contracts = cfg["tool"]["importlinter"]["contracts"]
    mine = [c for c in contracts if set(c.get("forbidden_modules", ())) == REFERENCE]
    assert len(mine) == 1
    sources = set(mine[0]["source_modules"])
    want = {"hisparse." + d.replace("/", ".") for d in DSA_SIDE}
    want |= {"hisparse." + f[:-3].replace("/", ".") for f in SHARED}
    assert sources == want
    assert not mine[0].get("allow_indirect_imports")
