"""The notebooks' "your turn" cells: every chapter has at least one; each grades a real
exercise, is saved unsolved (so a run as committed prints "not yet", not a traceback), and
the solution shown under it is the one in `solutions/` (so the two cannot drift apart)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK = re.compile(r'check\("(ch\d\d)\.(\w+)"')


def turns(path: Path) -> list[tuple[str, str, str, dict]]:
    """(chapter, exercise, the solution's code, the cell) for each check() cell."""
    cells = json.loads(path.read_text())["cells"]
    found = []
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] != "code" or not (m := CHECK.search(text)):
            continue
        after = next((c for c in cells[i + 1 :] if c["cell_type"] == "markdown"), None)
        shown = "".join(after["source"]) if after else ""
        code = re.search(r"<details>.*?```python\n(.*?)```", shown, re.S)
        found.append((m.group(1), m.group(2), code.group(1) if code else "", cell))
    return found


CASES = [(p.name, *t) for p in NOTEBOOKS for t in turns(p)]


def test_every_chapter_has_a_turn_in_its_notebook():
    chapters = {f"ch{p.name[:2]}" for p in NOTEBOOKS}
    assert len(chapters) == 10
    missing = chapters - {c for _, c, _, _, _ in CASES}
    assert not missing, f"no your-turn cell with check() in {sorted(missing)}"


@pytest.mark.parametrize("notebook, chapter, exercise, solution, cell", CASES)
def test_turn_is_saved_unsolved_and_says_not_yet(notebook, chapter, exercise, solution, cell):
    source = "".join(cell["source"])
    assert "raise NotImplementedError" in source, f"{notebook}: {exercise} is saved solved"
    shown = "".join("".join(out.get("text", "")) for out in cell.get("outputs", []))
    assert f"{chapter}.{exercise}: not yet" in shown, f"{notebook}: {exercise}'s saved output"


@pytest.mark.parametrize("notebook, chapter, exercise, solution, cell", CASES)
def test_turn_grades_an_exercise_and_shows_its_solution(
    notebook, chapter, exercise, solution, cell
):
    (tests,) = (ROOT / "tests" / "exercises").glob(f"test_{chapter}_*.py")
    assert f"def test_{chapter}_{exercise}" in tests.read_text(), f"no tests select {exercise}"
    module = tests.stem.removeprefix("test_")
    answers = (ROOT / "solutions" / f"{module}.py").read_text()
    assert solution.strip(), f"{notebook}: no <details> solution after check({exercise})"
    assert solution.strip() in answers, f"{notebook}: the solution shown for {exercise} drifted"
