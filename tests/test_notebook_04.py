"""Notebook 04 keeps its word: the files and symbols its prose names exist, its hidden
solutions are the graded answers, and its committed outputs read well unrun (no frozen
progress bars, no widget reprs).

Reads the notebook as JSON (nothing is executed: nbval runs it)."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

import solutions.ch04_tensorrt as answers

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "04_tensorrt.ipynb"
# The names the notebook imports its modules under, as it writes them in prose.
ALIASES = {
    "calibrate": "minillm.quant.calibrate",
    "fusion": "minillm.quant.fusion",
    "qdq": "minillm.export.qdq",
    "trt": "minillm.export.tensorrt",
    "bench": "benchmarks.calibration",
    "bench_trt": "benchmarks.tensorrt",
    "fp8": "minillm.quant.fp8",
    "lab": "minillm.lab",
}


@pytest.fixture(scope="module")
def cells() -> list[dict]:
    return json.loads(NOTEBOOK.read_text())["cells"]


def _text(cell: dict) -> str:
    return "".join(cell["source"])


def test_the_files_the_notebook_names_exist(cells):
    named = {
        path
        for cell in cells
        if cell["cell_type"] == "markdown"
        for path in re.findall(
            r"\b((?:minillm|benchmarks|exercises|solutions|tests)/[\w/]+\.\w+)", _text(cell)
        )
    }
    assert named, "the pattern found no file names: the test is broken"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"the notebook names files that do not exist: {missing}"


def test_the_symbols_its_prose_names_exist(cells):
    prose = "\n".join(_text(c) for c in cells if c["cell_type"] == "markdown")
    refs = set(re.findall(r"`(\w+)\.(\w+)", prose))
    checked = 0
    for alias, name in refs:
        module = ALIASES.get(alias)
        if module is None:
            continue
        checked += 1
        assert hasattr(importlib.import_module(module), name), f"`{alias}.{name}` does not exist"
    assert checked >= 5, f"only {checked} symbols checked: the pattern no longer matches the prose"


def test_each_your_turn_cell_grades_an_exercise_and_hides_its_answer(cells):
    turns = [
        (i, m.group(1))
        for i, c in enumerate(cells)
        if c["cell_type"] == "code"
        for m in [re.search(r'check\("ch04\.(\w+)"', _text(c))]
        if m
    ]
    assert {name for _, name in turns} == {
        n
        for n, f in inspect.getmembers(answers, inspect.isfunction)
        if f.__module__ == answers.__name__
    }, "every chapter 04 exercise has exactly one inline check, and no check names a missing one"
    for i, name in turns:
        skeleton = _text(cells[i])
        assert f'raise NotImplementedError("ch04: implement {name}")' in skeleton, (
            f"cell {i}: an unmodified run must print 'not yet'"
        )
        hidden = _text(cells[i + 1])
        assert hidden.startswith("<details><summary>Solution</summary>"), f"cell {i + 1}"
        source = inspect.getsource(getattr(answers, name)).rstrip()
        assert source in hidden, f"cell {i + 1}: the solution shown is not solutions' {name}"


def test_committed_outputs_read_well_unrun(cells):
    for i, cell in enumerate(cells):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            text = "".join(out.get("text", "")) + "".join(data.get("text/plain", ""))
            assert "application/vnd.jupyter.widget-view+json" not in data, f"cell {i}: a widget"
            assert not re.search(r"\d+%\|", text), f"cell {i}: a frozen progress bar"
            assert out.get("output_type") != "error", f"cell {i}: an error is committed"
