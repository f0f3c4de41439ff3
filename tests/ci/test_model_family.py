"""One model family, one engine (docs/architecture.md, "The reference model is gone"): the
reference sparse-MLA model, its engine and its vLLM class stay gone (no module of theirs, no
import of one anywhere in the repository's Python); the modules every model class shares import
nothing of the DeepSeek-V3.2 / GLM-5 family, at any level of a file; and the import-linter
contract that keeps it so in CI is in pyproject.toml."""

from __future__ import annotations

import ast

import pytest
import tomllib

from tests import REPO_ROOT

PKG = REPO_ROOT / "hisparse"
#: The retired family's modules: the model, its export, its vLLM class, its engine (the top
#: level of hisparse/engine/) and the engine's door to the host pool.
RETIRED_ENGINE = (
    "batch config forward hostkv hybrid hybrid_moves hybrid_plan indexer kvstore layer loop "
    "prefill requests results run"
).split()
RETIRED = {
    "hisparse.models.reference",
    "hisparse.models.reference_config",
    "hisparse.models.checkpoint",
    "hisparse.vllm.model",
    "hisparse.connector.host_rows",
    *(f"hisparse.engine.{m}" for m in RETIRED_ENGINE),
}
#: The DSA family, and the modules beside it that every model class uses.
FAMILY = {"hisparse.models.dsa", "hisparse.vllm.dsa"}
SHARED = [
    "models/rows.py",
    "models/checkpoint_files.py",
    "models/export_dir.py",
    "vllm/cache_layers.py",
    "vllm/step_metadata.py",
    "vllm/model_connector.py",
]
#: Where Python that could import the package lives.
SOURCES = ("hisparse", "tests", "benchmarks", "evals")


def _imports(path) -> set:
    """Every module a file imports, at any level of it (``from a import b``: a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _under(names: set, modules: set) -> list:
    return sorted(n for n in names if any(n == m or n.startswith(m + ".") for m in modules))


def test_no_module_of_the_retired_family_exists():
    named = [p for p in PKG.rglob("reference*") if p.suffix == ".py" or p.is_dir()]
    assert named == []
    gone = [m for m in RETIRED if (REPO_ROOT / (m.replace(".", "/") + ".py")).exists()]
    assert gone == []
    # The engines are subpackages now: the top level of hisparse/engine/ holds no module.
    assert sorted(p.name for p in (PKG / "engine").glob("*.py")) == ["__init__.py"]


@pytest.mark.parametrize("top", SOURCES)
def test_nothing_imports_the_retired_family(top):
    found = []
    for path in sorted((REPO_ROOT / top).rglob("*.py")):
        if "results" in path.relative_to(REPO_ROOT).parts:
            continue
        hits = _under(_imports(path), RETIRED)
        found += [f"{path.relative_to(REPO_ROOT)}: {h}" for h in hits]
    assert found == []


@pytest.mark.parametrize("path", SHARED)
def test_the_shared_modules_import_nothing_of_the_family(path):
    assert _under(_imports(PKG / path), FAMILY) == []


def test_the_contract_guards_the_same_modules():
    cfg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    contracts = cfg["tool"]["importlinter"]["contracts"]
    mine = [c for c in contracts if set(c.get("forbidden_modules", ())) == FAMILY]
    assert len(mine) == 1
    assert set(mine[0]["source_modules"]) == {
        "hisparse." + f[:-3].replace("/", ".") for f in SHARED
    }
    for c in contracts:  # no contract has an exception
        assert not c.get("allow_indirect_imports") and not c.get("ignore_imports"), c["name"]
