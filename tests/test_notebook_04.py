"""Notebook 04's your-turn cells: one per chapter 04 exercise, each left unsolved (an unmodified
run prints "not yet") with the graded answer hidden under it. What every notebook must
keep (names that exist, outputs that read well) is in test_notebooks.py.

Reads the notebook as JSON (nothing is executed: nbval runs it)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

import solutions.ch04_tensorrt as answers

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "04_tensorrt.ipynb"


@pytest.fixture(scope="module")
def cells() -> list[dict]:
    return json.loads(NOTEBOOK.read_text())["cells"]


def _text(cell: dict) -> str:
    return "".join(cell["source"])


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
