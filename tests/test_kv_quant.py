"""Quantized KV caches (int8, fp8): the quantizer's error bounds, the contiguous and paged
caches store codes and agree with each other, and the engine serves from a quantized pool
(swaps and copy-on-write included) with the same tokens as a plain loop over the
contiguous quantized cache."""

from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams, load_tokenizer
from minillm.cache import KVCache
from minillm.cache.kv_quant import KVQuant, kv_quant
from minillm.cache.paged import PagedKVCache
from minillm.engine import Engine


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantize_round_trip_within_the_formats_step(name):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 64) * torch.logspace(-3, 2, 4)[:, None, None]  # scales differ
    x[0, 0] = 0.0  # an all-zero vector (padding) survives exactly
    quant = KVQuant(name)
    codes, scale = quant.quantize(x)
    assert codes.dtype == quant.dtype and scale.shape == (4, 3, 1)
    back = quant.dequantize(codes, scale, torch.float32)
    assert back[0, 0].eq(0).all()
    err = (back - x).abs()
    if quant.is_int:  # round to nearest on a grid of `scale`: at most half a step
        assert (err <= scale / 2 + 1e-7 * scale).all()
    else:  # float8: relative rounding of 2^-(mantissa bits + 1) for values in normal range
        mantissa = {"fp8_e4m3": 3, "fp8_e5m2": 2}[name]
        normal = x.abs() >= scale * torch.finfo(quant.dtype).tiny
        assert (err[normal] <= x.abs()[normal] * 2.0 ** -(mantissa + 1) + 1e-12).all()


def test_unknown_kv_cache_dtype_names_the_choices():
    with pytest.raises(ValueError, match="int8, fp8"):
        kv_quant("int4")
    assert kv_quant("auto") is None


@pytest.mark.parametrize("name", ["int8", "fp8"])
@torch.inference_mode()
def test_contiguous_quantized_cache_stores_codes_and_stays_close(model, prompts, name):
    cfg = model.config
    ids = torch.tensor([prompts[1]])
    plain, quant = KVCache(cfg, 1, 32), KVCache(cfg, 1, 32, kv_cache_dtype=name)
    assert quant.k.dtype == KVQuant(name).dtype
    per_value = 1 + 4 / cfg.head_dim  # one byte of code, plus a 4-byte scale per head_dim
    assert quant.nbytes / plain.nbytes == pytest.approx(per_value / 4)
    for cache in (plain, quant):
        cache.kv_len = ids.shape[1]
    ref, got = model(ids, cache=plain), model(ids, cache=quant)
    assert got.dtype == ref.dtype
    err = (got - ref).abs().max() / ref.abs().max()
    assert 0 < err < {"int8": 0.01, "fp8": 0.05}[name]  # changed, but only a little


@torch.inference_mode()
def test_paged_quantized_cache_reads_what_the_contiguous_one_reads(model, prompts):
    """The same per-token quantization in both layouts: the same attention inputs."""
    cfg = model.config
    ids = torch.tensor([prompts[1]])
    n = ids.shape[1]
    contiguous = KVCache(cfg, 1, n, kv_cache_dtype="int8")
    paged = PagedKVCache(cfg, num_blocks=4, block_size=4, kv_cache_dtype="int8")
    table = [2, 0, 3]  # out of order on purpose
    paged.plan([], [(table, n)])
    torch.testing.assert_close(model(ids, cache=paged), model(ids, cache=contiguous))


def test_the_triton_kernel_refuses_a_quantized_pool(model):
    with pytest.raises(ValueError, match="use_kernel=False"):
        PagedKVCache(model.config, 4, 4, use_kernel=True, kv_cache_dtype="int8")


@torch.inference_mode()
def greedy_on_contiguous(model, prompt: list[int], n: int, kv_cache_dtype: str) -> list[int]:
    """The reference: one sequence, token by token, on the contiguous quantized cache."""
    cache = KVCache(model.config, 1, len(prompt) + n, kv_cache_dtype=kv_cache_dtype)
    cache.kv_len = len(prompt)
    logits = model(torch.tensor([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        cache.kv_len += 1
        pos = torch.tensor([[cache.kv_len - 1]])
        logits = model(torch.tensor([[out[-1]]]), pos, cache=cache)[0, -1]
    return out


@pytest.mark.parametrize(
    "pool",
    [
        dict(),
        dict(num_blocks=12, block_size=4, max_num_seqs=3),  # recompute preemptions
        dict(num_blocks=12, block_size=4, max_num_seqs=3, preemption_mode="swap"),
    ],
    ids=["roomy", "recompute", "swap"],
)
def test_engine_on_an_int8_pool_gives_the_reference_tokens(model, prompts, pool):
    tok = load_tokenizer()
    engine = Engine(model, tok, kv_cache_dtype="int8", **pool)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    outs = engine.run_to_completion()
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [greedy_on_contiguous(model, p, 12, "int8") for p in prompts]
    if pool:
        assert engine.scheduler.num_preemptions > 0  # the tight pool did preempt


def test_forked_samples_copy_the_scales_with_the_codes(model, prompts):
    """n = 2 shares the prompt's blocks; the first write to a shared partial block copies
    it (codes and scales), so both greedy samples match the reference."""
    engine = Engine(model, load_tokenizer(), block_size=4, kv_cache_dtype="int8")
    engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=10, n=2))
    (out,) = engine.run_to_completion()
    want = greedy_on_contiguous(model, prompts[1], 10, "int8")
    assert [c.token_ids for c in out.outputs] == [want, want]
