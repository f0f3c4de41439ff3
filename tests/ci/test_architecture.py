"""docs/architecture.md against the tree: the subpackages and modules it names exist, every
subpackage and every module of the connector, runtime, ops, models and CLI layers is named, the
top level holds only subpackages, and the size rule (modules <= 300 lines, functions <= 60)."""

from __future__ import annotations

import ast
import re

from tests import REPO_ROOT

PKG = REPO_ROOT / "hisparse"
DOC = (REPO_ROOT / "docs" / "architecture.md").read_text()
#: Layers whose every module the page names (the engine has its own map in docs/engine.md).
MAPPED = ("ops", "runtime", "connector", "models", "cli")


def _subpackages():
    return sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())


def test_top_level_holds_only_subpackages():
    modules = sorted(p.name for p in PKG.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py"]
    for name in _subpackages():
        assert f"hisparse/{name}/" in DOC or f"hisparse.{name}" in DOC, name


def test_every_module_of_the_mapped_layers_is_named():
    missing = []
    for layer in MAPPED:
        for p in sorted((PKG / layer).glob("*.py")):
            if p.name != "__init__.py" and f"{p.name}" not in DOC:
                missing.append(f"{layer}/{p.name}")
    assert missing == []


def test_every_named_module_exists():
    named = set(
        re.findall(r"`(?:hisparse/)?((?:ops|runtime|connector|models|vllm|cli)/\w+\.py)`", DOC)
    )
    assert named, "the page names no module"
    assert sorted(n for n in named if not (PKG / n).is_file()) == []


def test_every_subpackage_says_what_it_may_import():
    for name in ("ops", "runtime", "connector", "models", "cli"):
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text())) or ""
        assert "import" in doc, name


def test_size_rule():
    too_long = []
    for p in sorted(PKG.rglob("*.py")):
        src = p.read_text()
        if src.count("\n") > 300:
            too_long.append(f"{p.relative_to(PKG)}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    too_long.append(f"{p.relative_to(PKG)}:{node.name}: {n} lines")
    assert too_long == []
