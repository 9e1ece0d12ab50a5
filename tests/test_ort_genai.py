"""ONNX Runtime GenAI, the production reference of chapter 03: its model builder on the
bundled checkpoint (fp32, CPU) decodes the same greedy tokens as minillm and scores the
same logits."""

from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams, generate
from minillm.export.ort_genai import GenaiDecoder, build_genai_model
from minillm.model.weights import BUNDLED_DIR


@pytest.fixture(scope="module")
def genai_dir(tmp_path_factory):
    return build_genai_model(BUNDLED_DIR, tmp_path_factory.mktemp("genai"), "fp32")


@pytest.fixture(scope="module")
def genai(genai_dir) -> GenaiDecoder:
    return GenaiDecoder(genai_dir)


def test_genai_decodes_minillms_greedy_tokens(genai, model, prompts):
    want = generate(model, prompts, SamplingParams(temperature=0, max_tokens=16))
    assert genai.generate(prompts, 16) == want


def test_two_threads_decode_the_same_tokens(genai, genai_dir, prompts):
    """The thread count goes into the session options GenAI reads (a config overlay: GenAI
    refuses a key it does not know), and changes no token."""
    assert GenaiDecoder(genai_dir, threads=2).generate(prompts, 16) == genai.generate(prompts, 16)


@torch.inference_mode()
def test_genai_prefill_logits_equal_minillms(genai, model, prompts):
    ids = torch.tensor([prompts[1]])
    torch.testing.assert_close(genai.logits_fn()(ids), model(ids), atol=1e-4, rtol=1e-4)


def test_unknown_precision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fp32, fp16, int4"):
        build_genai_model(BUNDLED_DIR, tmp_path, "int3")
