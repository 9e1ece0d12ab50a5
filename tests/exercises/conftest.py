"""The switch between the learner's code and the reference answers.

    MINILLM_IMPL=solutions   (default) grade `solutions/`: what CI runs
    MINILLM_IMPL=exercises   grade `exercises/`: what a learner runs

Each chapter's tests take one fixture that is the implementation module of that
chapter; a new chapter adds one line at the bottom of this file:

    ch02 = impl_module("ch02_kv_cache")

An exercise still raising `NotImplementedError` fails (it is not skipped: the
learner should see red) with a one-line "not implemented yet" message instead
of a traceback.

No `__init__.py` in this folder on purpose: with one, pytest would import this
folder as a package named `exercises` and hide the real `exercises/` package.
The repository root must be on sys.path (`pythonpath = ["."]` in pyproject's
`[tool.pytest.ini_options]`, or `PYTHONPATH=.`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from exercises.check import OVERRIDES

IMPLS = ("solutions", "exercises")
ENV_VAR = "MINILLM_IMPL"
REPO_ROOT = Path(__file__).resolve().parents[2]


def current_impl() -> str:
    """`solutions` or `exercises`, from $MINILLM_IMPL (unset or empty: solutions)."""
    impl = os.environ.get(ENV_VAR, "").strip() or "solutions"
    if impl not in IMPLS:
        raise pytest.UsageError(
            f"{ENV_VAR}={impl!r} is not a valid implementation: use one of {', '.join(IMPLS)} "
            f"(e.g. `{ENV_VAR}=exercises pytest tests/exercises -k ch01`)"
        )
    return impl


def load_impl(chapter_module: str) -> ModuleType:
    """Import `<impl>.<chapter_module>`, e.g. `exercises.ch01_basics`."""
    name = f"{current_impl()}.{chapter_module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, current_impl()):
            raise  # the module exists but imports something missing: show the real error
        message = (
            f"cannot import {name!r}: run pytest from the repository root with the root on "
            f'sys.path (pyproject: [tool.pytest.ini_options] pythonpath = ["."], or '
            f"PYTHONPATH=.), and check that {name.replace('.', '/')}.py exists"
        )
    except SyntaxError as e:  # the learner's file does not parse: say where, without noise
        message = f"{name} does not import: SyntaxError: {e.msg} ({e.filename}:{e.lineno})"
    pytest.fail(message, pytrace=False)


def impl_module(chapter_module: str) -> Callable[[], ModuleType]:
    """A session fixture returning the implementation module of one chapter."""

    @pytest.fixture(scope="session")
    def _impl() -> ModuleType:
        module = load_impl(chapter_module)
        overrides = OVERRIDES.get(chapter_module)
        if not overrides:
            return module
        # A notebook's `check` grades the learner's functions over the answers.
        patched = ModuleType(module.__name__, module.__doc__)
        patched.__dict__.update(vars(module) | overrides)
        return patched

    _impl.__doc__ = f"The module `<{ENV_VAR}>.{chapter_module}` under test."
    return _impl


def pytest_configure(config: pytest.Config) -> None:
    current_impl()  # a bad MINILLM_IMPL stops the run before any test


def pytest_report_header(config: pytest.Config) -> str:
    return f"minillm exercises: grading {current_impl()}/ ({ENV_VAR})"


# The test that skeletons and answers share one API checks the course, not the
# learner: leave it out when grading exercises.
_GRADING = os.environ.get(ENV_VAR, "").strip() == "exercises"
collect_ignore = ["test_api_parity.py"] if _GRADING else []


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame that raised, relative to the repo root."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    path = Path(tb.tb_frame.f_code.co_filename)
    if path.is_relative_to(REPO_ROOT):
        path = path.relative_to(REPO_ROOT)
    return f"{path}:{tb.tb_lineno}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    try:
        return (yield)
    except NotImplementedError as e:
        message = f"not implemented yet: {e} ({_where(e)})"
    pytest.fail(message, pytrace=False)  # outside `except`: no chained traceback


# One line per chapter: the fixture the chapter's tests take as an argument.
ch01 = impl_module("ch01_basics")
ch02 = impl_module("ch02_kv_cache")
ch03 = impl_module("ch03_onnx")
ch04 = impl_module("ch04_tensorrt")
ch05 = impl_module("ch05_torch_compile")
ch06 = impl_module("ch06_quantization")
ch07 = impl_module("ch07_paged_attention")
ch08 = impl_module("ch08_continuous_batching")
ch09 = impl_module("ch09_choosing_a_stack")
ch10 = impl_module("ch10_speculative")
