"""Grade one exercise from inside a notebook: `check("ch02.cache_update", cache_update)`.

The notebooks' "your turn" cells define a function and call `check` on it. `check` runs
that exercise's tests from `tests/exercises/` (the same tests that `make grade` and CI
run) with the learner's function in place of the reference answer, and prints one
friendly verdict: how many checks passed, or every one that failed and why. No terminal
needed, so it works on Colab.

How the function gets in: the chapter's tests take the chapter's implementation module
as a fixture (`tests/exercises/conftest.py`). While `check` runs, that fixture returns
`solutions.<chapter>` with the learner's functions put over the answers' (`OVERRIDES`),
so each test grades only what the learner wrote.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = REPO_ROOT / "tests" / "exercises"

# chapter module ("ch02_kv_cache") -> {function name: the learner's function}, set by
# `check` for the duration of one pytest run and read by tests/exercises/conftest.py.
OVERRIDES: dict[str, dict[str, Callable[..., Any]]] = {}


class _Collect:
    """A pytest plugin that keeps each test's outcome and its failure message."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self.passed.append(report.nodeid)
        elif report.failed:
            self.failed.append((report.nodeid, _short(report)))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.failed.append((report.nodeid, _short(report)))


def _short(report: Any) -> str:
    """The message a failure ends with: the assertion and its explanation, without the
    traceback and without pytest's `+  where ...` lines (reprs of the objects compared,
    long and no help to a learner)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join([line for line in lines if not line.lstrip().startswith("+")][:8])


def _test_file(chapter: str) -> Path:
    """tests/exercises/test_chNN_*.py of a chapter ("ch02")."""
    found = sorted(TESTS.glob(f"test_{chapter}_*.py"))
    if len(found) != 1:
        chapters = sorted(p.name.split("_")[1] for p in TESTS.glob("test_ch*_*.py"))
        raise ValueError(f"no exercises for {chapter!r}: chapters with exercises: {chapters}")
    return found[0]


def check(
    exercise: str, fn: Callable[..., Any] | None = None, **fns: Callable[..., Any]
) -> Verdict:
    """Run the tests of `exercise` ("ch02.cache_update": chapter, then the name the tests
    carry) on your function(s) and print the verdict; truthy when every check passes.

    `fn` replaces the function named after the exercise; name others by keyword when an
    exercise has several (`check("ch10.verify", verify=my_verify, rollback=my_rollback)`).
    """
    chapter, _, name = exercise.partition(".")
    if not name:
        raise ValueError(f"{exercise!r}: write chapter.exercise, e.g. 'ch02.cache_update'")
    path = _test_file(chapter)
    module = path.stem.removeprefix("test_")
    overrides = ({name: fn} if fn is not None else {}) | fns
    answers = importlib.import_module(f"solutions.{module}")
    unknown = sorted(set(overrides) - set(dir(answers)))
    if unknown:
        raise ValueError(f"{module} has no function {', '.join(unknown)}: check the spelling")
    collect = _Collect()
    args = [str(path), "-k", name, "-q", "-p", "no:cacheprovider", f"--rootdir={REPO_ROOT}"]
    threads = torch.get_num_threads()
    # The base the overrides go over; and no third-party pytest plugins: the exercise
    # tests need none, and loading them (schemathesis, nbval, ...) made a notebook's
    # first check take 15 s longer.
    env = {"MINILLM_IMPL": "solutions", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    saved = {key: os.environ.get(key) for key in env}
    OVERRIDES[module] = overrides
    os.environ.update(env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            pytest.main(args, plugins=[collect])
    finally:
        OVERRIDES.pop(module, None)
        torch.set_num_threads(threads)  # the tests' conftest sets one thread
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return _verdict(exercise, collect)


@dataclass(frozen=True)
class Verdict:
    """What `check` answers: true when every check passed. Its line is printed already, so
    a notebook cell that ends with `check(...)` shows nothing more (no stray `False`)."""

    exercise: str
    passed: bool

    def __bool__(self) -> bool:
        return self.passed

    def _ipython_display_(self) -> None:
        pass  # Jupyter: the verdict line above is the whole answer


def _verdict(exercise: str, collect: _Collect) -> Verdict:
    total = len(collect.passed) + len(collect.failed)
    if total == 0:
        print(f"✗ {exercise}: no tests ran (is the exercise name right?)")
        return Verdict(exercise, False)
    if not collect.failed:
        print(f"✓ {exercise}: all {total} checks pass")
        return Verdict(exercise, True)
    test, message = collect.failed[0]
    if "not implemented yet" in message:
        print(f"… {exercise}: not yet: write the function's body, then run this cell again")
        return Verdict(exercise, False)
    print(f"✗ {exercise}: {len(collect.failed)} of {total} checks fail:")
    for test, message in collect.failed:  # every one: a pattern across cases is a hint
        print(f"  ✗ {test.split('::')[-1]}")
        print("      " + message.replace("\n", "\n      "))
    return Verdict(exercise, False)
