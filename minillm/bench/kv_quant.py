"""KV-cache quantization (chapters 06 and 07; `python -m benchmarks.kv_quant`): the memory
an int8 / fp8 cache gains, counted with chapter 07's simulator (`minillm.bench.paged`), and
the quality it loses on a real model: perplexity through the quantized cache and greedy
generations against the unquantized one."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from minillm.bench.paged import BUDGET, make_trace, simulate
from minillm.cache import KVCache
from minillm.cache.kv_quant import KV_CACHE_DTYPES
from minillm.engine.memory import kv_bytes_per_block
from minillm.generation import greedy_params
from minillm.generation.cached import decode, eager_decode_step, prefill
from minillm.model import ModelConfig, Transformer
from minillm.training import first_divergence, perplexity

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")


def bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str) -> int:
    """K and V of one token over all layers: codes and scales when quantized, else bf16
    (what a GPU server stores). The engine's pool arithmetic with a block of one token."""
    quantized = kv_cache_dtype in KV_CACHE_DTYPES
    return kv_bytes_per_block(cfg, 1, torch.bfloat16, kv_cache_dtype if quantized else "auto")


def memory_table(cfg: ModelConfig, requests: int) -> list[dict[str, Any]]:
    """Per format: bytes per token and requests running at once in the same byte budget."""
    trace = make_trace(requests)
    base = bytes_per_token(cfg, "bf16")
    rows = []
    for name in ("bf16", *FORMATS):
        per_token = bytes_per_token(cfg, name)
        slots = BUDGET * base // per_token  # the bf16 budget's bytes, in this format's tokens
        sim = simulate(trace, "paged-16", slots, 16)
        rows.append(
            {"format": name, "bytes_per_token": per_token, "slots": slots, **sim}
            | {"vs_bf16": base / per_token}
        )
    return rows


def print_memory(rows: list[dict[str, Any]], requests: int) -> None:
    """Table (a): `memory_table`'s rows."""
    print(f"\n(a) memory: {requests}-request trace, KV budget = {BUDGET} bf16 token slots")
    print(f"{'format':<10}{'B/token':>9}{'x bf16':>8}{'slots':>8}{'running':>9}{'preempt':>9}")
    for r in rows:
        print(
            f"{r['format']:<10}{r['bytes_per_token']:>9}{r['vs_bf16']:>8.2f}{r['slots']:>8}"
            f"{r['mean_running']:>9.1f}{r['preemptions']:>9}"
        )


def cached_logits(
    model: Transformer, kv_cache_dtype: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits_fn for `perplexity`: one forward through a fresh cache of that format."""
    device = model.lm_head.weight.device

    def fn(ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        cache = KVCache(model.config, b, t, model.lm_head.weight.dtype, device, kv_cache_dtype)
        return model(ids.to(device), cache=cache)

    return fn


@torch.inference_mode()
def greedy_outputs(
    model: Transformer, prompts: list[list[int]], n: int, kv_cache_dtype: str
) -> list[list[int]]:
    """`n` greedy tokens after each prompt, batched, through a cache of that format."""
    cache, logits, positions = prefill(model, prompts, n, kv_cache_dtype)
    return decode(model, cache, logits, positions, greedy_params(n), eager_decode_step)


def quality_table(
    model: Transformer,
    ids: torch.Tensor,
    window: int,
    windows: int,
    prompts: list[list[int]],
    tokens: int,
) -> list[dict[str, Any]]:
    """Per format: perplexity over `windows` x `window` tokens of `ids` and its change vs the
    unquantized cache; where each prompt's `tokens` greedy tokens first differ from the
    reference's, their median, and the share of prompts that never differ."""
    ref_ppl = perplexity(cached_logits(model, "auto"), ids, window, 4, windows)
    ref_out = greedy_outputs(model, prompts, tokens, "auto")
    rows = [{"format": "reference", "ppl": ref_ppl, "ppl_delta": 0.0}]
    for name in FORMATS:
        ppl = perplexity(cached_logits(model, name), ids, window, 4, windows)
        out = greedy_outputs(model, prompts, tokens, name)
        firsts = [first_divergence(a, b) for a, b in zip(ref_out, out, strict=True)]
        rows.append(
            {
                "format": name,
                "ppl": ppl,
                "ppl_delta": ppl / ref_ppl - 1,
                "first_divergence_median": statistics.median(firsts),
                "first_divergences": firsts,
                "identical": sum(f == tokens for f in firsts) / len(firsts),
            }
        )
    return rows


def print_quality(rows: list[dict[str, Any]], tokens: int, ref_dtype: torch.dtype) -> None:
    """Table (b): `quality_table`'s rows."""
    print(f"\n(b) quality (reference: K/V in {ref_dtype}); greedy over {tokens} tokens")
    print(f"{'format':<10}{'ppl':>9}{'delta':>9}{'first diff (median)':>21}{'identical':>11}")
    for r in rows:
        tail = ""
        if "identical" in r:
            tail = f"{r['first_divergence_median']:>21.0f}{r['identical']:>11.0%}"
        print(f"{r['format']:<10}{r['ppl']:>9.3f}{r['ppl_delta']:>+9.2%}{tail}")
