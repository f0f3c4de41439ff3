"""The repository stands alone: no citation of documents outside it, and every relative link in
the README and docs/ points at a file that is here."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests import REPO_ROOT

ROOT = str(REPO_ROOT)
# Built from parts so this file does not match itself.
OUTSIDE = re.compile(
    "|".join([r"DESIGN(\.md)?\s*" + "\u00a7", r"\.\./" + "shared", "shared/" + "DESIGN"])
)


def _repo_files():
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.splitlines() if os.path.isfile(os.path.join(ROOT, f))]


def test_no_citation_of_documents_outside_the_repo():
    hits = []
    for rel in _repo_files():
        try:
            text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_relative_links_in_docs_resolve():
    docs = ["README.md"] + [f for f in _repo_files() if f.startswith("docs/") and f.endswith(".md")]
    missing = []
    for rel in docs:
        text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), target.split("#")[0]))
            if not os.path.exists(path):
                missing.append(f"{rel}: {target}")
    assert not missing, missing


def test_hardware_facts_are_in_the_repo():
    text = open(os.path.join(ROOT, "docs", "hardware.md"), encoding="utf-8").read()
    # The numbers other documents lean on: plan's default rate and the row-rate bound.
    assert "~46 GB/s" in text and "rows per second" in text and "656 B" in text
