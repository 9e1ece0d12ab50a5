"""The KV cache changes how much work generation does, never what it generates."""

import pytest
import torch
from helpers import greedy
from hf_reference import build_hf

from minillm import SamplingParams, generate, generate_naive, load_model
from minillm.bench.kv_cache import hf_greedy
from minillm.cache import KVCache
from minillm.model import ModelConfig, Transformer


def test_cached_greedy_equals_naive_greedy(model, prompts):
    for p in prompts:
        assert generate(model, [p], greedy(40)) == [generate_naive(model, p, greedy(40))]


def test_cached_logits_match_full_forward_at_every_step(model, prompts):
    """Decode step by step through the cache; compare each step's logits with a full
    forward over the whole sequence so far."""
    p = prompts[1]
    seq = p + generate_naive(model, p, greedy(30))
    cache = KVCache(model.config, 1, len(seq))
    with torch.inference_mode():
        cache.kv_len = len(p)
        step_logits = [model(torch.tensor([p]), cache=cache)[0, -1]]
        for pos in range(len(p), len(seq) - 1):
            cache.kv_len = pos + 1
            x, at = torch.tensor([[seq[pos]]]), torch.tensor([[pos]])
            step_logits.append(model(x, at, cache=cache)[0, -1])
        full = model(torch.tensor([seq]))[0, len(p) - 1 : -1]
    torch.testing.assert_close(torch.stack(step_logits), full, atol=1e-4, rtol=0)


def test_batched_equals_one_at_a_time(model, prompts):
    alone = [generate(model, [p], greedy(24))[0] for p in prompts]
    assert generate(model, prompts, greedy(24)) == alone
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=5, ignore_eos=True)
    alone = [generate(model, [p], sampled)[0] for p in prompts]
    assert generate(model, prompts, sampled) == alone
    assert alone[0] == generate_naive(model, prompts[0], sampled)


def test_batched_stops_each_sequence_at_its_own_eos(model, prompts):
    free = generate(model, prompts, greedy(20))
    stop = free[1][5]  # a token the second sequence emits
    out = generate(model, prompts, greedy(20, stop_token_ids=[stop]))
    for full, cut in zip(free, out, strict=True):
        expected = full[: full.index(stop) + 1] if stop in full else full
        assert cut == expected


@pytest.mark.parametrize("case", ["llama-gqa-tied", "llama3-rope-scaling", "qwen2-qkv-bias"])
def test_equals_transformers_generate_with_cache(case, tmp_path):
    hf = build_hf(case, tmp_path)
    ours = load_model(tmp_path)
    prompts = [[5, 17, 3, 42, 8], [9, 1, 60]]
    for p in prompts:  # transformers' batched generate left-pads; compare one by one
        assert generate(ours, [p], greedy(32))[0] == hf_greedy(hf, p, 32, use_cache=True)
    batched = generate(ours, prompts, greedy(32))
    assert batched == [generate(ours, [p], greedy(32))[0] for p in prompts]


def test_cache_bytes_follow_the_formula_and_store_kv_heads():
    cfg = ModelConfig(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)
    cache = KVCache(cfg, batch_size=4, max_len=100)
    expected = 2 * 3 * 4 * 2 * 100 * cfg.head_dim * 4  # 2 (K,V) x layers x B x kv x S x d x fp32
    assert cache.nbytes == expected
    assert cache.k.shape == (3, 4, 2, 100, cfg.head_dim)  # kv heads, not query heads


def test_refuses_a_cache_longer_than_the_context():
    cfg = ModelConfig(max_position_embeddings=64)
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        KVCache(cfg, 1, 65)
    model = Transformer(cfg).eval()
    with pytest.raises(ValueError, match="shorten the prompt or lower max_tokens"):
        generate(model, [[1] * 60], greedy(10))
