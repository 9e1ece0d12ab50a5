"""Chapter 02 benchmark: what the KV cache buys, measured on this machine.

    python -m benchmarks.kv_cache [--quick] [--threads N] [--json results.json]

Four parts, each printed as a table; the last line is one `SUMMARY kv-cache:` line.

(a) Cost of one generation step at context length n, without a cache (a forward over
    all n tokens, what `generate_naive` does) and with one (one token at position n-1
    against n cached K/V), A/B interleaved; then end-to-end time of generating up to N
    total tokens both ways (same tokens asserted), measured directly up to 1024 and
    predicted for 2048 by summing fitted per-step costs (checked against the direct
    measurement at 1024). Model: the bundled model's shapes with 2048 positions and
    random weights: speed depends on shapes, not on what the weights learned.
(b) KV bytes = 2 x layers x kv_heads x head_dim x bytes x tokens, checked against a real
    `KVCache` allocation, and what grouped-query attention saves for SmolLM2-135M and
    Llama-3-8B shapes (pure arithmetic).
(c) minillm `generate` vs transformers `generate(use_cache=True)` and `use_cache=False`
    on the bundled model: same greedy tokens asserted, time ratios interleaved.
(d) Roofline: batch-1 cached decode of a SmolLM2-135M-shaped random model, bytes read
    per token x tokens/s vs the copy bandwidth measured in the same run; where the rest
    of the time goes (`profile_split`).

Every speed figure is a ratio of calls timed in alternation in the same run, or a
fraction of a ceiling measured in the same run: absolute times on a shared machine
are noise. The functions are importable: the chapter 02 notebook calls them with
smaller sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from minillm import SamplingParams, generate, generate_naive, load_model, load_tokenizer
from minillm.cache import KVCache
from minillm.lab import format_bytes, measure_roofline, paired_ratios, profile_split, time_samples
from minillm.model import (
    BUNDLED_DIR,
    ModelConfig,
    Transformer,
    load_config,
    random_model,
)
from minillm.model.shapes import SMOLLM2_135M

ROOT = Path(__file__).resolve().parents[1]

SEED = 0
PROMPT = "And the LORD said unto Moses, Speak unto"

# Attention shapes only (layers, query heads, kv heads, head_dim): enough for KV bytes.
KV_SHAPES = {
    "SmolLM2-135M": (30, 9, 3, 64),
    "Llama-3-8B": (32, 32, 8, 128),
}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def long_context_model(max_len: int = 2048, seed: int = SEED) -> Transformer:
    """The bundled model's shapes (d128, 4 layers, 4 heads / 2 kv heads, vocab 4096) with
    `max_len` positions and random weights (the trained model only has 256 positions)."""
    cfg = dataclasses.replace(load_config(BUNDLED_DIR), max_position_embeddings=max_len)
    return random_model(cfg, seed)


def random_ids(model: Transformer, n: int, seed: int = SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g)


# ------------------------------------------------------------- (a) cost per step, total


def step_fns(model: Transformer, n: int) -> dict[str, Callable[[], Any]]:
    """One generation step at context length n, both ways. `naive`: a forward over all n
    tokens (generate_naive's step). `cached`: the n-th token alone, at position n-1,
    attending to n cached K/V (the first n-1 filled by a prefill beforehand)."""
    ids = random_ids(model, n)
    cache = KVCache(model.config, 1, n)
    with torch.inference_mode():
        cache.kv_len = n - 1
        if n > 1:
            model(ids[:, : n - 1], cache=cache)
    cache.kv_len = n
    last, pos = ids[:, n - 1 :], torch.tensor([[n - 1]])

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
            same = torch.allclose(fns["naive"](), fns["cached"](), atol=1e-4, rtol=0)
        assert same, f"cached step logits differ from the full forward at n={n}"
        samples = time_samples(fns, repeats=repeats, warmup=warmup)
        # The fastest repeat: the cost with the least noise from other processes added.
        out["naive_s"].append(min(samples["naive"]))
        out["cached_s"].append(min(samples["cached"]))
        out["ratio"].append(paired_ratios(samples, "cached")["naive"])
    return out


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
    and with `generate` (cached), interleaved; asserts both give the same tokens."""
    prompt = random_ids(model, prompt_len)[0].tolist()
    params = greedy(total - prompt_len)
    tokens: dict[str, list[int]] = {}

    def naive() -> None:
        tokens["naive"] = generate_naive(model, prompt, params)

    def cached() -> None:
        tokens["cached"] = generate(model, [prompt], params)[0]

    samples = time_samples({"naive": naive, "cached": cached}, repeats=repeats, warmup=warmup)
    same = tokens["naive"] == tokens["cached"]
    assert same, f"cached and naive generation disagree at {total} tokens"
    return {
        "total": total,
        "naive_s": statistics.median(samples["naive"]),
        "cached_s": statistics.median(samples["cached"]),
        "speedup": paired_ratios(samples, "cached")["naive"],
        "same_tokens": same,
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


# ----------------------------------------------------------- (c) minillm vs transformers


def compare_hf(
    new_tokens: int = 200, repeats: int = 5, warmup: int = 1, uncached: bool = True
) -> dict[str, Any]:
    """Bundled model, greedy, `new_tokens` tokens, EOS disabled on both sides: time of
    transformers' generate (use_cache=True, and False) relative to minillm's generate."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model, tok = load_model(), load_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly new_tokens, like ignore_eos
    prompt_ids = tok.encode(PROMPT)
    prompt = torch.tensor([prompt_ids])
    out: dict[str, list[int]] = {}

    def ours() -> None:
        out["minillm"] = generate(model, [prompt_ids], greedy(new_tokens))[0]

    def theirs(use_cache: bool) -> Callable[[], None]:
        def call() -> None:
            with torch.inference_mode():
                ids = hf.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    use_cache=use_cache,
                    pad_token_id=0,
                )
            out[f"HF use_cache={use_cache}"] = ids[0, len(prompt_ids) :].tolist()

        return call

    fns = {"minillm": ours, "HF use_cache=True": theirs(True)}
    if uncached:
        fns["HF use_cache=False"] = theirs(False)
    samples = time_samples(fns, repeats=repeats, warmup=warmup)
    ratios = paired_ratios(samples, "minillm")
    same = all(out[name] == out["minillm"] for name in fns)
    assert same, "minillm and transformers generated different tokens"
    assert len(out["minillm"]) == new_tokens
    return {
        "new_tokens": new_tokens,
        "same_tokens": same,
        "time_ratio": ratios,  # time / minillm's time
        "tokens_per_s": {k: new_tokens / statistics.median(v) for k, v in samples.items()},
    }


# ------------------------------------------------------------------------- (d) roofline


def decode_roofline(
    cfg: ModelConfig | dict[str, Any] = SMOLLM2_135M,
    context: int = 64,
    repeats: int = 10,
    copy_bytes: int = 512 * 2**20,
    split: bool = True,
) -> dict[str, Any]:
    """Batch-1 cached decode at `context` tokens: tokens/s x bytes read per token (every
    weight once, plus the K/V read by attention) vs the copy bandwidth measured here on
    a `copy_bytes` buffer (default: larger than any CPU cache: main memory)."""
    model = random_model(cfg)
    fn = step_fns(model, context)["cached"]
    roof = measure_roofline(copy_bytes=copy_bytes)
    # Best of `repeats`, like the ceiling it is compared with (best of its runs): on a
    # shared machine a median mixes in other processes' use of the memory bus.
    step_s = min(time_samples({"decode": fn}, repeats=repeats, warmup=2)["decode"])
    c = model.config
    weights = sum(p.nbytes for p in model.parameters())  # a tied embedding counts once
    kv = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 4) * context
    per_token = weights + kv
    bound_tps = roof.bytes_per_s / per_token
    out: dict[str, Any] = {
        "params": model.num_parameters(),
        "weight_bytes": weights,
        "kv_bytes_read": kv,
        "bytes_per_token": per_token,
        "bandwidth_Bps": roof.bytes_per_s,
        "tokens_per_s": 1 / step_s,
        "bound_tokens_per_s": bound_tps,
        "fraction_of_bound": (1 / step_s) / bound_tps,
        "achieved_Bps": per_token / step_s,
    }
    if split:
        s = profile_split(fn, repeats=3, warmup=1)
        out["split"] = s.fractions()
        # Bandwidth inside the kernels alone: the same-run step time, less its overhead share.
        out["kernel_Bps"] = out["achieved_Bps"] / s.kernel_fraction
    return out


# ----------------------------------------------------------------------------- printing


def print_steps(costs: dict[str, Any]) -> None:
    print("\n(a) one generation step at context length n (best-of ms, ratio paired median)")
    print(f"{'n':>6} {'no cache ms':>12} {'cache ms':>9} {'no cache / cache':>17}")
    for n, a, b, r in zip(
        costs["lengths"], costs["naive_s"], costs["cached_s"], costs["ratio"], strict=True
    ):
        print(f"{n:>6} {a * 1e3:>12.2f} {b * 1e3:>9.3f} {r:>16.1f}x")


def print_e2e(rows: list[dict[str, Any]], predicted: dict[int, dict[str, float]]) -> None:
    print("\n(a) end to end: generate from a 16-token prompt up to N total tokens")
    print(f"{'N':>6} {'how':<28} {'no cache s':>10} {'cache s':>8} {'speedup':>8}")
    for r in rows:
        how = "measured (same tokens)" if r["same_tokens"] else "measured (TOKENS DIFFER)"
        print(f"{r['total']:>6} {how:<28} {r['naive_s']:>10.2f} {r['cached_s']:>8.2f}", end="")
        print(f" {r['speedup']:>7.1f}x")
    for n, p in predicted.items():
        how = "predicted from step ratios"
        print(f"{n:>6} {how:<28} {p['naive_s']:>10.2f} {p['cached_s']:>8.2f} {p['speedup']:>7.1f}x")


def print_gqa(rows: list[dict[str, Any]], alloc: dict[str, Any], tokens: int) -> None:
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


def print_hf(r: dict[str, Any]) -> None:
    print(f"\n(c) bundled model, {r['new_tokens']} new greedy tokens; same tokens: ", end="")
    print(r["same_tokens"])
    print(f"{'generator':<22} {'time / minillm':>15} {'tokens/s (this run)':>20}")
    for name, ratio in r["time_ratio"].items():
        print(f"{name:<22} {ratio:>14.2f}x {r['tokens_per_s'][name]:>20.0f}")


def print_roofline(r: dict[str, Any]) -> None:
    print("\n(d) roofline, SmolLM2-135M-shaped random model, batch-1 cached decode, fp32")
    print(f"  bytes read per token: {format_bytes(r['bytes_per_token'])} ", end="")
    print(f"(weights {format_bytes(r['weight_bytes'])} + KV {format_bytes(r['kv_bytes_read'])})")
    print(f"  measured copy bandwidth: {r['bandwidth_Bps'] / 1e9:.1f} GB/s", end="")
    print(f" -> bound {r['bound_tokens_per_s']:.1f} tokens/s")
    print(f"  measured decode: {r['tokens_per_s']:.1f} tokens/s = ", end="")
    print(f"{r['achieved_Bps'] / 1e9:.1f} GB/s = {r['fraction_of_bound']:.0%} of the bound")
    if "split" in r:
        parts = ", ".join(f"{k} {v:.0%}" for k, v in r["split"].items())
        print(f"  where a decode step's time goes: {parts}")
        print(f"  bandwidth inside the kernels alone: {r['kernel_Bps'] / 1e9:.1f} GB/s", end="")
        print(f" = {r['kernel_Bps'] / r['bandwidth_Bps']:.0%} of the copy bandwidth")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (about 30 s)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {args.threads} thread(s), quick={args.quick}")

    if args.quick:
        lengths, e2e_lengths, predict_at, new_tokens, ctx = [64, 256, 512], [256], [1024], 64, 32
    else:
        lengths, e2e_lengths = [64, 128, 256, 512, 1024, 2048], [256, 1024]
        predict_at, new_tokens, ctx = [1024, 2048], 200, 64
    model = long_context_model(max(max(lengths), max(predict_at)))
    costs = step_costs(model, lengths, repeats=3 if args.quick else 5)
    print_steps(costs)
    e2e = [end_to_end(model, n, repeats=2) for n in e2e_lengths]
    predicted = {n: predicted_totals(costs, 16, n) for n in sorted({*e2e_lengths, *predict_at})}
    print_e2e(e2e, predicted)

    tokens = 8192
    gqa, alloc = gqa_table(tokens), kv_allocation_check()
    print_gqa(gqa, alloc, tokens)

    hf = compare_hf(new_tokens, repeats=3 if args.quick else 5)
    print_hf(hf)

    roof = decode_roofline(context=ctx, repeats=5 if args.quick else 10)
    print_roofline(roof)

    results = {
        "threads": args.threads,
        "quick": args.quick,
        "model_a": "bundled shapes (d128, 4 layers), random weights, "
        f"{model.config.max_position_embeddings} positions",
        "step_costs": costs,
        "end_to_end": e2e,
        "predicted": predicted,
        "gqa": gqa,
        "kv_allocation": alloc,
        "hf": hf,
        "roofline": roof,
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    measured = e2e[-1]
    pred = predicted[predict_at[-1]]
    ratios = hf["time_ratio"]
    summary = (
        f"SUMMARY kv-cache: speedup {measured['speedup']:.1f}x at {measured['total']} tokens "
        f"(measured), {pred['speedup']:.1f}x at {predict_at[-1]} (predicted); step at "
        f"{lengths[-1]}: {costs['ratio'][-1]:.1f}x; HF use_cache=True takes "
        f"{ratios['HF use_cache=True']:.2f}x minillm's time"
    )
    if "HF use_cache=False" in ratios:
        summary += f", use_cache=False {ratios['HF use_cache=False']:.2f}x"
    summary += (
        f"; GQA saves {gqa[0]['saving']:.0f}x (SmolLM2-135M), {gqa[1]['saving']:.0f}x "
        f"(Llama-3-8B); decode at {roof['fraction_of_bound']:.0%} of the bandwidth bound "
        f"({roof['tokens_per_s']:.1f}/{roof['bound_tokens_per_s']:.1f} tok/s); "
        f"{args.threads} thread(s), {results['seconds']:.0f} s"
    )
    print(summary)
    return results


if __name__ == "__main__":
    main()
