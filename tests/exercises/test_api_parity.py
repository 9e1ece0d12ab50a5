"""The course's own check: every skeleton in `exercises/` has the API of its answer.

Not a grading test (conftest.py leaves this file out when MINILLM_IMPL=exercises).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import solutions

CHAPTERS = sorted(m.name for m in pkgutil.iter_modules(solutions.__path__) if m.name[:2] == "ch")


def public_functions(module) -> dict:
    return {
        name: fn
        for name, fn in inspect.getmembers(module, inspect.isfunction)
        if not name.startswith("_") and fn.__module__ == module.__name__
    }


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_exercises_have_the_api_of_solutions(chapter):
    answers = public_functions(importlib.import_module(f"solutions.{chapter}"))
    skeletons = public_functions(importlib.import_module(f"exercises.{chapter}"))
    assert sorted(skeletons) == sorted(answers), f"exercises/{chapter}.py lists other functions"
    prefix = chapter.split("_")[0]
    for name, fn in skeletons.items():
        assert inspect.signature(fn) == inspect.signature(answers[name]), name
        assert len(inspect.getdoc(fn) or "") > 200, f"{name}: the skeleton's docstring teaches"
        assert f'NotImplementedError("{prefix}: implement {name}")' in inspect.getsource(fn)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_solutions_do_not_import_minillm(chapter):
    """The answers are written from scratch: the tests compare them with minillm."""
    tree = ast.parse(Path(solutions.__path__[0], f"{chapter}.py").read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        assert not any(n.split(".")[0] == "minillm" for n in names), f"{chapter} imports minillm"
