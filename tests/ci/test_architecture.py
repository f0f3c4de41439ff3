"""The package against its maps. docs/architecture.md names every subpackage and, layer by layer,
every module (the engine's in docs/engine.md's code map instead); every module a map names
exists; every repository path and file name a docs/ page names exists; the top level holds only
subpackages; the size rule (modules <= 300 lines, functions <= 60)."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest

from tests import REPO_ROOT

PKG = REPO_ROOT / "hisparse"
DOCS = REPO_ROOT / "docs"
DOC = (DOCS / "architecture.md").read_text()
#: The layer whose module map is its own page, not architecture.md.
OWN_MAP = {"engine": "engine.md"}
#: Names a docs/ map may leave out on purpose, by page (none today).
PENDING: dict = {"engine.md": set()}
#: What a repository path cited in docs/ starts with.
TOP = ("hisparse", "tests", "benchmarks", "csrc", "evals", "docs", ".ci", ".buildkite")
#: A page that lists what left the tree: its names are gone on purpose.
GONE = {"experiments.md"}


def _subpackages() -> list:
    """Every subpackage, nested ones included, as paths under hisparse/ ("engine/graph")."""
    return sorted(str(p.parent.relative_to(PKG)) for p in PKG.rglob("*/__init__.py"))


def _layers() -> list:
    return sorted(s for s in _subpackages() if "/" not in s)


def _modules(layer: str) -> list:
    """The modules of a layer, nested subpackages' included, relative to it ("dsa/config.py")."""
    root = PKG / layer
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py")


def _items() -> dict:
    """architecture.md's "The layers, bottom up": each layer's item text (two layers can share
    one item)."""
    part = DOC[DOC.index("## The layers, bottom up") :]
    part = part[: part.index("\n## ", 3)]
    out = {}
    for item in re.findall(r"^\d+\. .*(?:\n {3}.*)*", part, flags=re.M):
        for layer in re.findall(r"\*\*`hisparse/(\w+)/`\*\*", item.split("—")[0]):
            out[layer] = item
    return out


def _code_map() -> set:
    """The modules docs/engine.md's code map names, relative to hisparse/engine/."""
    text = (DOCS / "engine.md").read_text()
    part = text[text.index("## Code map") :]
    part = part[: part.index("\n## ", 3)]
    named = set()
    for row in re.findall(r"^\| (`.*)$", part, flags=re.M):
        first, rest = row.split(" | ", 1)
        for name in re.findall(r"`([\w/]+(?:\.py)?)`", first):
            if name.endswith("/"):
                named |= {name + m for m in re.findall(r"`(\w+\.py)`", rest)}
            else:
                named.add(name)
    return named


def _named_in_item(module: str, item: str) -> bool:
    """A nested module counts as named by its path, or by its file name beside its subpackage."""
    *dirs, name = module.split("/")
    return f"`{module}`" in item or (f"`{name}`" in item and all(f"{d}/" in item for d in dirs))


def test_top_level_holds_only_subpackages():
    modules = sorted(p.name for p in PKG.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py"]
    for name in _layers():
        assert f"hisparse/{name}/" in DOC or f"hisparse.{name}" in DOC, name


def test_every_layer_has_an_item_and_every_subpackage_is_named():
    items = _items()
    assert sorted(items) == _layers()
    engine_map = "\n".join(sorted(_code_map()))
    missing = []
    for sub in _subpackages():
        layer, _, nested = sub.partition("/")
        last = nested.rsplit("/", 1)[-1]
        if nested and f"{last}/" not in (engine_map if layer in OWN_MAP else items[layer]):
            missing.append(sub)
    assert missing == []


def test_every_module_is_named_in_its_layers_map():
    items, engine_map = _items(), _code_map()
    missing = []
    for layer in _layers():
        for m in _modules(layer):
            if layer in OWN_MAP:
                if m not in engine_map and m not in PENDING[OWN_MAP[layer]]:
                    missing.append(f"{layer}/{m} (docs/{OWN_MAP[layer]})")
            elif not _named_in_item(m, items[layer]):
                missing.append(f"{layer}/{m} (docs/architecture.md)")
    assert missing == []


def test_every_module_a_map_names_exists():
    items, layers = _items(), _layers()
    gone = []
    for layer, item in items.items():
        mine = [x for x in layers if items.get(x) is item]  # the layers this item covers
        for name in re.findall(r"`((?:\w+/)*\w+\.py)`", item):
            if name.split("/")[0] in layers:
                found = (PKG / name).is_file()
            else:
                found = any(m == name or m.endswith("/" + name) for x in mine for m in _modules(x))
            if not found:
                gone.append(f"{layer}: {name}")
    engine = set(_modules("engine"))
    gone += [f"engine: {m}" for m in sorted(_code_map() - engine - PENDING["engine.md"])]
    assert gone == []


def _repo_files() -> list:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.splitlines() if (REPO_ROOT / f).is_file()]


def _cited_paths(text: str) -> set:
    """Repository paths ("hisparse/x.py", "benchmarks/results/a.{json,md}") and modules by their
    layer ("connector/y.py")."""
    by_layer = rf"(?<![\w./-])((?:{'|'.join(_layers())})/[\w/]*\.py)\b"
    paths = {f"hisparse/{p}" for p in re.findall(by_layer, text)}
    top = "|".join(re.escape(t) for t in TOP)
    for p in re.findall(rf"(?<![\w./{{-])((?:{top})/[\w./{{}},-]*[\w/}}])", text):
        m = re.match(r"(.*)\{([\w.,]+)\}(.*)", p)
        paths |= {m[1] + alt + m[3] for alt in m[2].split(",")} if m else {p}
    return paths


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md") if p.name not in GONE))
def test_every_path_and_file_a_docs_page_names_exists(page):
    files = _repo_files()
    dirs = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    names = {f.rsplit("/", 1)[-1] for f in files}
    text = (DOCS / page).read_text()
    missing = sorted(p for p in _cited_paths(text) if p not in files and p.rstrip("/") not in dirs)
    missing += sorted({n for n in re.findall(r"`(\w+\.(?:py|md|cu|cuh|cpp|h|sh))`", text)} - names)
    assert [m for m in missing if m not in PENDING.get(page, ())] == []


def test_every_subpackage_says_what_it_may_import():
    for name in _layers():
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text())) or ""
        pending = "import" in PENDING.get(f"hisparse/{name}/__init__.py", ())
        assert "import" in doc or pending, name


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
