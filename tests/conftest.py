"""Fixtures shared by the package tests."""

import pytest

from minillm import load_model, load_tokenizer

# Three prompts of different lengths (3, 9 and 2 tokens with the bundled tokenizer).
PROMPTS = ["In the beginning", "And the LORD said unto Moses, Speak unto", "Blessed"]


@pytest.fixture(scope="session")
def model():
    """The bundled model, loaded once (tests only read it; a test file may override
    `model` with a model of its own)."""
    return load_model()


@pytest.fixture(scope="session")
def prompts():
    tok = load_tokenizer()
    return [tok.encode(p) for p in PROMPTS]
