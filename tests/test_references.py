"""Every file path and `minillm.*` name that the docs, notebooks and code mention exists.

Prose drifts when code moves: a notebook that tells the learner to open `minillm/paged.py`
after the file moved is a broken lesson. This test reads the Markdown files, every
notebook cell and the package's own source text, and checks each repository path
(`minillm/...py`, `benchmarks/...py`, `notebooks/...ipynb`, ...) and each dotted name
(`minillm.cache.paged.PagedKVCache`) against the tree and the importable package.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import resolve

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    *ROOT.glob("*.md"),
    *ROOT.glob("docs/*.md"),
    *ROOT.glob("exercises/*.md"),
    *ROOT.glob("minillm/**/*.md"),
    *ROOT.glob("notebooks/*.ipynb"),
    *ROOT.glob("minillm/**/*.py"),
    *ROOT.glob("benchmarks/*.py"),
    *ROOT.glob("exercises/*.py"),
    *ROOT.glob("solutions/*.py"),
    *ROOT.glob("tests/**/*.py"),
    ROOT / "Makefile",
]
# A path inside the repository, as prose writes it (optionally followed by :line or ::test).
PATH_RE = re.compile(
    r"(?<![\w/.-])((?:minillm|benchmarks|notebooks|exercises|solutions|tests)"
    r"/[\w./-]*\w\.(?:py|ipynb|md|json))"
)
NAME_RE = re.compile(r"(?<![\w/.])(minillm(?:\.\w+)+)")
IGNORED_NAMES = {"minillm.egg"}  # build metadata, not code
# Colab's first cell clones the repository into ./minillm, so there a path of the package
# reads minillm/minillm/...: checked as the repository path it names.
COLAB_CLONE = "minillm/minillm/"


def _text(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    nb = json.loads(path.read_text())
    return "\n".join("".join(cell["source"]) for cell in nb["cells"])  # not the outputs


def _references() -> list[tuple[str, str, str]]:
    refs = []
    for doc in DOCS:
        if doc.resolve() == Path(__file__).resolve():
            continue
        text = _text(doc)
        rel = str(doc.relative_to(ROOT))
        refs += [(rel, "path", p.rstrip(".")) for p in PATH_RE.findall(text)]
        refs += [(rel, "name", n.rstrip(".")) for n in NAME_RE.findall(text)]
    return sorted(set(refs))


REFS = _references()


def test_the_scan_finds_references() -> None:
    assert len(REFS) > 100  # the regexes still match what the docs write


@pytest.mark.parametrize("doc", sorted({d for d, _, _ in REFS}))
def test_every_reference_exists(doc: str) -> None:
    missing = []
    for d, kind, ref in REFS:
        if d != doc or ref in IGNORED_NAMES or "chNN" in ref:
            continue
        if kind == "path" and ref.startswith(COLAB_CLONE):  # the same file on Colab
            ref = ref.removeprefix(COLAB_CLONE.removesuffix("minillm/"))
        ok = (ROOT / ref).exists() if kind == "path" else resolve(ref) is not None
        if not ok:
            missing.append(ref)
    assert not missing, f"{doc} names what does not exist: {missing}"
