"""The claims tables: sources read in English, verdicts and evidence kinds from fixed sets;
CLAIMS.md's tables copied from the committed notebooks, and no figure outside them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import FIGURE

from benchmarks import claims_ledger
from minillm.lab.claims import Claim, cite, claims_table


@pytest.mark.parametrize(
    "source, want",
    [
        ("A 七 Why", "A 7 (vLLM and PagedAttention) Why"),
        ("A 十", "A 10 (roadmap)"),
        ("A 一 问题二", "A 1 (inference vs training), question 2"),
        ("B 5", "B 5 (vLLM)"),
        ("B 4.1 (2); A 四 Why", "B 4.1 (TensorRT) (2); A 4 (TensorRT) Why"),
        ("A FAQ Q10 / B 5", "A FAQ Q10 / B 5 (vLLM)"),
    ],
)
def test_cite_gives_every_source_its_english_title(source, want):
    assert cite(source) == want


def test_a_claim_needs_a_known_verdict_and_kind():
    with pytest.raises(ValueError, match="holds with conditions"):
        Claim("B 5", "c", "m", "mostly true", "measured")
    with pytest.raises(ValueError, match="argued"):
        Claim("B 5", "c", "m", "holds", "vibes")


def test_the_table_shows_the_kind_beside_the_verdict():
    table = claims_table([Claim("A 七 How", "pages", "97%", "holds", "measured")])
    assert "| A 7 (vLLM and PagedAttention) How | pages | 97% | **holds** (measured) |" in table
    assert "七" not in table


# ---------------------------------------------------------------- CLAIMS.md, the ledger

ROOT = Path(__file__).resolve().parents[1]


def test_each_ledger_table_is_its_notebooks_saved_output():
    """CLAIMS.md's tables are what `python -m benchmarks.claims_ledger` copies from the
    committed notebooks now: a notebook re-run and saved without the ledger following fails."""
    text = claims_ledger.CLAIMS.read_text()
    assert claims_ledger.update(text) == text, (
        f"CLAIMS.md differs from the notebooks' claims tables: run {claims_ledger.COMMAND}"
    )


def test_every_chapter_has_its_table_with_its_run():
    text = claims_ledger.CLAIMS.read_text()
    for chapter in claims_ledger.chapters():
        rows, run = claims_ledger.rows(chapter)
        assert rows, f"notebook {chapter} shows no claims rows"
        assert re.search(r"\d{4}-\d\d-\d\d", run), f"notebook {chapter}'s run line has no date"
        assert f"| {chapter}.{len(rows)} |" in text


def test_the_ledger_states_no_figure_outside_its_generated_tables():
    """Outside the generated blocks CLAIMS.md describes set-ups and commands: a measured
    figure there would have no source (the GPU column is checked below)."""
    text = claims_ledger.CLAIMS.read_text()
    for chapter in claims_ledger.chapters():
        text = claims_ledger.block(chapter).sub("", text)
    found = FIGURE.findall(text)
    assert not found, f"CLAIMS.md states {found} outside the generated tables: put it in a notebook"


def reported(figure: str, values: list[float]) -> bool:
    """Does some value of the report print as `figure` (at its decimals, as is or in %)?"""
    decimals = len(figure.partition(".")[2])
    want = float(figure)
    return any(round(v, decimals) == want or round(100 * v, decimals) == want for v in values)


def test_the_gpu_column_states_only_what_the_gpu_report_says():
    """Every figure of a GPU note is a value of benchmarks/results/gpu-h200.md as printed
    (rounded, or as a percentage); a ledger row it points to ("see 06.6") must exist."""
    report = (ROOT / "benchmarks" / "results" / "gpu-h200.md").read_text()
    values = [float(v) for v in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?", report)]
    rows = {
        f"{c}.{i}"
        for c in claims_ledger.chapters()
        for i in range(1, len(claims_ledger.rows(c)[0]) + 1)
    }
    for key, note in claims_ledger.GPU.items():
        figures = re.findall(r"(?<![\w.])\d+(?:\.\d+)?", note)
        missing = [f for f in figures if f not in rows and not reported(f, values)]
        assert not missing, f"GPU note {key} states {missing}: not in gpu-h200.md"


def test_table_cells_keep_pipes_inside_code():
    row = "| B 5 | `a | b` and c | 1.5x \\| 2x | **holds** (measured) |"
    assert claims_ledger.cells_of(row) == [
        "B 5",
        "`a | b` and c",
        "1.5x \\| 2x",
        "**holds** (measured)",
    ]


def test_the_table_names_the_run_it_came_from():
    table = claims_table([Claim("B 5", "c", "m", "holds", "measured")])
    assert re.search(
        r"\*This run: .+, \d+ cores, \d+ torch thread\(s\), torch .+, \d{4}-\d\d-\d\d\*$", table
    )
