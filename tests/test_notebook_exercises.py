"""The notebooks' "your turn" cells: each grades a real exercise, and the solution shown
under it is the one in `solutions/` (so the two cannot drift apart)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK = re.compile(r'check\("(ch\d\d)\.(\w+)"')


def turns(path: Path) -> list[tuple[str, str, str]]:
    """(chapter, exercise, the solution's code) for each check() cell of a notebook."""
    cells = json.loads(path.read_text())["cells"]
    found = []
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] != "code" or not (m := CHECK.search(text)):
            continue
        after = next((c for c in cells[i + 1 :] if c["cell_type"] == "markdown"), None)
        shown = "".join(after["source"]) if after else ""
        code = re.search(r"<details>.*?```python\n(.*?)```", shown, re.S)
        found.append((m.group(1), m.group(2), code.group(1) if code else ""))
    return found


CASES = [(p.name, *t) for p in NOTEBOOKS for t in turns(p)]


def test_every_chapter_with_exercises_has_a_turn_in_its_notebook():
    # grows with the notebooks; at least the ones converted so far
    assert {c for _, c, _, _ in CASES} >= {"ch07"}


@pytest.mark.parametrize("notebook, chapter, exercise, solution", CASES)
def test_turn_grades_an_exercise_and_shows_its_solution(notebook, chapter, exercise, solution):
    (tests,) = (ROOT / "tests" / "exercises").glob(f"test_{chapter}_*.py")
    assert f"def test_{chapter}_{exercise}" in tests.read_text(), f"no tests select {exercise}"
    module = tests.stem.removeprefix("test_")
    answers = (ROOT / "solutions" / f"{module}.py").read_text()
    assert solution.strip(), f"{notebook}: no <details> solution after check({exercise})"
    assert solution.strip() in answers, f"{notebook}: the solution shown for {exercise} drifted"
