"""The claims tables: sources read in English, verdicts and evidence kinds from fixed sets."""

from __future__ import annotations

import pytest

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
