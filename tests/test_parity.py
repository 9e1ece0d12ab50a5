"""minillm must compute what transformers computes, on the same weights (offline).

Each case builds a small random transformers model from a config, saves it as an
HF checkpoint, loads that directory into minillm and compares logits and greedy
tokens. The configs cover GQA, tied and untied embeddings, Llama-3 rope scaling
and Qwen2's q/k/v bias.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_reference import BASE, CASES, LLAMA3_ROPE, build_hf

from minillm import SamplingParams, generate_naive, load_model, save_model
from minillm.bench.kv_cache import hf_greedy
from minillm.model import ModelConfig, Transformer


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = build_hf(case, tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers_for_32_steps(case, tmp_path):
    hf = build_hf(case, tmp_path)
    ours = load_model(tmp_path)
    prompt = [5, 17, 3, 42, 8]
    expected = hf_greedy(hf, prompt, 32, use_cache=False)
    got = generate_naive(
        ours, prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    )
    assert got == expected


def test_saved_checkpoint_loads_in_transformers_and_round_trips(tmp_path):
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    cfg.rope_scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    save_model(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    again = load_model(tmp_path / "ours")
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
        assert torch.equal(again(ids), model(ids))


def test_sharded_checkpoint_loads(tmp_path):
    cfg = ModelConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, tie_word_embeddings=False
    )
    model = Transformer(cfg).eval()
    save_model(model, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path)(ids), model(ids))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
