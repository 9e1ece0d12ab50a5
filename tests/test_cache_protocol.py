"""The model talks to any cache through one method, `attention`, and nothing else; the
rotation frequencies survive half-precision casts."""

from __future__ import annotations

import pytest
import torch

from minillm.cache import KVCache
from minillm.model import Transformer
from minillm.model.transformer import rope_cos_sin


class OnlyAttention:
    """Exposes `attention` and nothing else: any other attribute the model reached for
    would raise AttributeError."""

    def __init__(self, inner: KVCache) -> None:
        self._inner = inner
        self.calls: list[int] = []

    def attention(self, layer, q, k, v, positions):
        self.calls.append(layer)
        return self._inner.attention(layer, q, k, v, positions)


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Transformer:
    return tiny_model(num_hidden_layers=3)


@torch.inference_mode()
def test_the_model_needs_nothing_but_attention(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 9))
    cache = OnlyAttention(KVCache(tiny.config, 2, 16))
    prompt = tiny(ids[:, :6], cache=cache)
    steps = [tiny(ids[:, t : t + 1], torch.full((2, 1), t), cache=cache) for t in (6, 7, 8)]
    full = tiny(ids)
    torch.testing.assert_close(prompt, full[:, :6])
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 6:], atol=1e-5, rtol=1e-5)
    assert cache.calls == [0, 1, 2] * 4  # every layer, in order, once per forward


def test_a_mask_with_a_cache_is_refused(tiny):
    ids = torch.zeros(1, 2, dtype=torch.long)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="without one"):
        tiny(ids, mask=mask, cache=KVCache(tiny.config, 1, 4))


@pytest.mark.parametrize("cast", ["half", "bf16", "to_bf16_cpu"])
def test_rope_frequencies_stay_fp32_through_casts(tiny, cast):
    ref = tiny.inv_freq.clone()
    model = Transformer(tiny.config)
    model.load_state_dict(tiny.state_dict())
    model = {
        "half": lambda m: m.half(),
        "bf16": lambda m: m.bfloat16(),
        "to_bf16_cpu": lambda m: m.to("cpu", torch.bfloat16),
    }[cast](model)
    assert model.lm_head.weight.dtype != torch.float32
    assert model.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.inv_freq, ref, rtol=0, atol=0)
    # what it buys: at position 8000 the fp16 table would be off by radians
    pos = torch.tensor([[8000]])
    cos32, _ = rope_cos_sin(model.inv_freq, pos)
    cos16, _ = rope_cos_sin(ref.half(), pos)
    assert (cos32 - cos16.float()).abs().max() > 0.1
    torch.testing.assert_close(cos32, rope_cos_sin(ref, pos)[0])


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("t", [1, 5])
def test_grouped_sdpa_is_torchs_gqa_attention(heads, kv_heads, t):
    """Folding a kv head's query heads into its rows is a re-indexing, not a new formula:
    the same outputs as torch's enable_gqa SDPA, for each row's own mask (rows of several
    lengths), on strided K/V (a cache's window of a longer buffer)."""
    from minillm.cache.protocol import grouped_sdpa, masked_sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads, t, 16, generator=g)
    k = torch.randn(3, kv_heads, 40, 16, generator=g)[:, :, :29]
    v = torch.randn(3, kv_heads, 40, 16, generator=g)[:, :, :29]
    lengths = torch.tensor([29, 11, 1])
    slots = torch.arange(29)
    mask = slots < (lengths[:, None] - t + 1 + torch.arange(t))[:, None, :, None].clamp(min=1)
    torch.testing.assert_close(grouped_sdpa(q, k, v, mask), masked_sdpa(q, k, v, mask))
