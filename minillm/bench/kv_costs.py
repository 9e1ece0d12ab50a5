"""Chapter 02 benchmark, parts (a) and (b): what the KV cache saves in time (one generation
step with and without it, and whole generations, measured and predicted) and what it costs
in memory (bytes per token, grouped-query attention), with the helpers both need.

The other parts are `minillm.bench.kv_cache` (c) and `minillm.bench.roofline` (d);
`minillm.bench.kv_cache` re-exports all of it for the chapter 02 notebook.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minillm.bench.workload import SEED
from minillm.cache import KVCache
from minillm.generation import generate, generate_naive, greedy_params
from minillm.lab import format_bytes, paired_ratios, time_samples
from minillm.model import BUNDLED_DIR, ModelConfig, Transformer, load_config, random_model
from minillm.model.shapes import SMOLLM2_135M
from minillm.training import first_divergence

# Attention shapes only (layers, query heads, kv heads, head_dim): enough for KV bytes.
KV_SHAPES = {
    "SmolLM2-135M": (30, 9, 3, 64),
    "Llama-3-8B": (32, 32, 8, 128),
}


def long_context_model(max_len: int = 2048, seed: int = SEED) -> Transformer:
    """The bundled model's shapes (d128, 4 layers, 4 heads / 2 kv heads, vocab 4096) with
    `max_len` positions and random weights (the trained model only has 256 positions)."""
    cfg = dataclasses.replace(load_config(BUNDLED_DIR), max_position_embeddings=max_len)
    return random_model(cfg, seed)


def random_ids(model: Transformer, n: int, seed: int = SEED) -> torch.Tensor:
    """[1, n] random token ids on the model's device (drawn on the CPU: the same ids anywhere)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
    return ids.to(model.lm_head.weight.device)


# ------------------------------------------------------------- (a) cost per step, total


def step_fns(model: Transformer, n: int) -> dict[str, Callable[[], Any]]:
    """One generation step at context length n, both ways. `naive`: a forward over all n
    tokens (generate_naive's step). `cached`: the n-th token alone, at position n-1,
    attending to n cached K/V (the first n-1 filled by a prefill beforehand)."""
    ids = random_ids(model, n)
    weight = model.lm_head.weight
    cache = KVCache(model.config, 1, n, weight.dtype, weight.device)
    with torch.inference_mode():
        cache.kv_len = n - 1
        if n > 1:
            model(ids[:, : n - 1], cache=cache)
    cache.kv_len = n
    last, pos = ids[:, n - 1 :], torch.tensor([[n - 1]], device=weight.device)

    @torch.inference_mode()
    def naive() -> torch.Tensor:
        return model(ids)[:, -1]

    @torch.inference_mode()
    def cached() -> torch.Tensor:
        return model(last, pos, cache=cache)[:, -1]  # rewrites slot n-1: same work each call

    return {"naive": naive, "cached": cached}


def step_costs(
    model: Transformer,
    lengths: Sequence[int],
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = False,
) -> dict[str, Any]:
    """Seconds of one step with and without the cache at each context length (best of
    `repeats`), and the paired ratio naive / cached (median of per-round ratios)."""
    out: dict[str, Any] = {"lengths": list(lengths), "naive_s": [], "cached_s": [], "ratio": []}
    items: Any = lengths
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(lengths, desc="step cost", leave=False)
    for n in items:
        fns = step_fns(model, n)
        with torch.inference_mode():
            a, b = fns["naive"]().float(), fns["cached"]().float()
        # fp32: within 1e-4 (summation order); bf16 (a GPU's default): within its rounding
        atol = 1e-4 if model.lm_head.weight.dtype == torch.float32 else 0.25
        same = torch.allclose(a, b, atol=atol, rtol=0)
        assert same, f"cached step logits differ from the full forward at n={n}"
        samples = time_samples(fns, repeats=repeats, warmup=warmup)
        # The fastest repeat: the cost with the least noise from other processes added.
        out["naive_s"].append(min(samples["naive"]))
        out["cached_s"].append(min(samples["cached"]))
        out["ratio"].append(paired_ratios(samples, "cached")["naive"])
    return out


def cached_step_sweep(
    model: Transformer, lengths: Sequence[int], repeats: int = 15, warmup: int = 2
) -> dict[str, Any]:
    """Seconds of one cached decode step at each context length, the lengths interleaved
    (each round times every length once, from a different one each round) so that a slow
    spell of a shared machine spreads over all of them. One cache, prefilled once to the
    longest length; the step at length n attends to the first n slots (re-writing slot
    n-1 with the same K/V the prefill wrote). Returns per length the median and the
    quartiles of the samples, and the samples themselves (to resample: a trend the
    resampled estimates do not agree on is noise)."""
    longest = max(lengths)
    ids = random_ids(model, longest)
    weight = model.lm_head.weight
    cache = KVCache(model.config, 1, longest, weight.dtype, weight.device)
    with torch.inference_mode():
        cache.kv_len = longest - 1
        model(ids[:, : longest - 1], cache=cache)

    def step(n: int) -> Callable[[], Any]:
        pos = torch.tensor([[n - 1]], device=weight.device)

        @torch.inference_mode()
        def call() -> torch.Tensor:
            cache.kv_len = n
            return model(ids[:, n - 1 : n], pos, cache=cache)[:, -1]

        return call

    samples = time_samples({n: step(n) for n in lengths}, repeats=repeats, warmup=warmup)
    quartiles = {n: statistics.quantiles(s, n=4) for n, s in samples.items()}
    return {
        "lengths": list(lengths),
        "median_s": [statistics.median(samples[n]) for n in lengths],
        "q1_s": [quartiles[n][0] for n in lengths],
        "q3_s": [quartiles[n][2] for n in lengths],
        "repeats": repeats,
        "samples_s": {n: samples[n] for n in lengths},
    }


def fit_poly(xs: Sequence[float], ys: Sequence[float], degree: int = 2) -> list[float]:
    """Least-squares coefficients c0 + c1 x + c2 x^2 ... (float64)."""
    x = torch.tensor(xs, dtype=torch.float64)
    a = torch.stack([x**k for k in range(degree + 1)], dim=1)
    return (
        torch.linalg.lstsq(a, torch.tensor(ys, dtype=torch.float64)[:, None])
        .solution[:, 0]
        .tolist()
    )


def poly(coeffs: Sequence[float], x: float) -> float:
    """The polynomial of `fit_poly`'s coefficients at x."""
    return sum(c * x**k for k, c in enumerate(coeffs))


def predicted_totals(costs: dict[str, Any], prompt_len: int, total: int) -> dict[str, float]:
    """Speed-up of generating from `prompt_len` up to `total` tokens, from per-step costs.

    The speed-up is sum(naive(n)) / sum(cached(n)) over the steps n = prompt_len..total-1,
    = sum(ratio(n) x cached(n)) / sum(cached(n)). The paired ratios naive/cached are
    robust to a busy machine (both halves of a pair see the same load), so they carry
    the result: a quadratic fit of ratio(n) (naive steps grow like n and n^2, cached
    ones barely), weighted by a linear fit of the cached step's best time (flat if the
    noise makes its slope negative). Seconds are the best-of times' sums, for scale."""
    lengths = costs["lengths"]
    ratio_fit = fit_poly(lengths, costs["ratio"], 2)
    cached_fit = fit_poly(lengths, costs["cached_s"], 1)
    if cached_fit[1] < 0:
        cached_fit = [statistics.median(costs["cached_s"]), 0.0]
    steps = range(prompt_len, total)
    cached = [poly(cached_fit, n) for n in steps]
    naive = [max(poly(ratio_fit, n), 1.0) * c for n, c in zip(steps, cached, strict=True)]
    return {"naive_s": sum(naive), "cached_s": sum(cached), "speedup": sum(naive) / sum(cached)}


def end_to_end(
    model: Transformer, total: int, prompt_len: int = 16, repeats: int = 1, warmup: int = 0
) -> dict[str, Any]:
    """Generate from a `prompt_len`-token prompt up to `total` tokens with `generate_naive`
    and with `generate` (cached), interleaved; asserts both give the same tokens. Each call
    is one pair of calls: at 1024 tokens on SmolLM2 the naive one takes most of an hour."""
    prompt = random_ids(model, prompt_len)[0].tolist()
    params = greedy_params(total - prompt_len)
    tokens: dict[str, list[int]] = {}

    def naive() -> None:
        tokens["naive"] = generate_naive(model, prompt, params)

    def cached() -> None:
        tokens["cached"] = generate(model, [prompt], params)[0]

    samples = time_samples({"naive": naive, "cached": cached}, repeats=repeats, warmup=warmup)
    # Equal in every run so far; recorded, not asserted: over a thousand fp32 greedy steps a
    # near-tie could flip (the two paths sum in different orders), and the hour of timing
    # stays valid (ignore_eos: both generate the same number of tokens either way).
    same = tokens["naive"] == tokens["cached"]
    return {
        "total": total,
        "naive_s": statistics.median(samples["naive"]),
        "cached_s": statistics.median(samples["cached"]),
        "speedup": paired_ratios(samples, "cached")["naive"],
        "same_tokens": same,
        "first_difference": first_divergence(tokens["naive"], tokens["cached"]),
    }


# --------------------------------------------------------------------- (b) KV bytes, GQA


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element, for one token."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def gqa_table(tokens: int = 8192, dtype_bytes: int = 2) -> list[dict[str, Any]]:
    """KV bytes per token and for `tokens` tokens (batch 1), with the model's kv heads
    (GQA) and with one kv head per query head (multi-head attention)."""
    rows = []
    for name, (layers, heads, kv_heads, head_dim) in KV_SHAPES.items():
        gqa = kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes)
        mha = kv_bytes_per_token(layers, heads, head_dim, dtype_bytes)
        rows.append(
            {
                "model": name,
                "layers": layers,
                "heads": heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "per_token_gqa": gqa,
                "per_token_mha": mha,
                "total_gqa": gqa * tokens,
                "total_mha": mha * tokens,
                "saving": mha / gqa,
            }
        )
    return rows


def kv_allocation_check(
    cfg: ModelConfig | dict[str, Any] = SMOLLM2_135M, batch: int = 1, max_len: int = 1024
) -> dict[str, Any]:
    """Allocate a real fp32 KVCache and compare its bytes with the formula."""
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_hf(cfg)
    cache = KVCache(cfg, batch, max_len, torch.float32)
    per_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4)
    formula = per_token * batch * max_len
    return {
        "shape": list(cache.k.shape),
        "nbytes": cache.nbytes,
        "formula": formula,
        "match": cache.nbytes == formula,
    }


# ----------------------------------------------------------------------------- printing


def print_steps(costs: dict[str, Any]) -> None:
    """The table of `step_costs`: per context length, both steps' best times and their ratio."""
    print("\n(a) one generation step at context length n (best-of ms, ratio paired median)")
    print(f"{'n':>6} {'no cache ms':>12} {'cache ms':>9} {'no cache / cache':>17}")
    for n, a, b, r in zip(
        costs["lengths"], costs["naive_s"], costs["cached_s"], costs["ratio"], strict=True
    ):
        print(f"{n:>6} {a * 1e3:>12.2f} {b * 1e3:>9.3f} {r:>16.1f}x")


def print_e2e(rows: list[dict[str, Any]], predicted: dict[int, dict[str, float]]) -> None:
    """The end-to-end table: `end_to_end` rows (measured) and `predicted_totals` (predicted)."""
    print("\n(a) end to end: generate from a 16-token prompt up to N total tokens")
    print(f"{'N':>6} {'how':<28} {'no cache s':>10} {'cache s':>8} {'speedup':>8}")
    if not rows and not predicted:
        return
    for r in rows:
        how = "measured (same tokens)" if r["same_tokens"] else "measured (TOKENS DIFFER)"
        print(f"{r['total']:>6} {how:<28} {r['naive_s']:>10.2f} {r['cached_s']:>8.2f}", end="")
        print(f" {r['speedup']:>7.1f}x")
    for n, p in predicted.items():
        how = "predicted from step ratios"
        print(f"{n:>6} {how:<28} {p['naive_s']:>10.2f} {p['cached_s']:>8.2f} {p['speedup']:>7.1f}x")


def print_gqa(rows: list[dict[str, Any]], alloc: dict[str, Any], tokens: int) -> None:
    """The table of `gqa_table` and the line of `kv_allocation_check`."""
    print("\n(b) KV cache bytes, bf16, batch 1 (2 x layers x kv_heads x head_dim x 2 B x tokens)")
    print(
        f"{'model':<14} {'heads/kv':>8} {'per token GQA':>14} {'MHA':>10} "
        f"{f'{tokens} tok GQA':>14} {'MHA':>10} {'saving':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<14} {r['heads']:>3}/{r['kv_heads']:<4} "
            f"{format_bytes(r['per_token_gqa']):>14} {format_bytes(r['per_token_mha']):>10} "
            f"{format_bytes(r['total_gqa']):>14} {format_bytes(r['total_mha']):>10} "
            f"{r['saving']:>6.0f}x"
        )
    print(
        f"real KVCache {alloc['shape']} fp32 (x2 for K and V): nbytes {alloc['nbytes']:,} "
        f"== formula {alloc['formula']:,}: {alloc['match']}"
    )
