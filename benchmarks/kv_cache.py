"""Chapter 02 benchmark: what the KV cache buys, measured on this machine.

    python -m benchmarks.kv_cache [--model smollm2] [--quick] [--threads N] [--json out.json]
                                  [--roofline] [--llama-cpp]

`--model` (default `smollm2`: SmolLM2-135M-Instruct, offline; `bundled` for the course's
1.3M model; or any checkpoint `load_model` takes) is the model of every part. Four parts,
each printed as a table; the last line is one `SUMMARY kv-cache:` line.

(a) Cost of one generation step at context length n, without a cache (a forward over
    all n tokens, what `generate_naive` does) and with one (one token at position n-1
    against n cached K/V), A/B interleaved; then end-to-end time of generating up to N
    total tokens both ways (same tokens asserted), measured directly (at 256 and 1024
    tokens; at 1024 on SmolLM2 the naive loop alone takes most of an hour on one thread)
    and predicted for 2048 by summing fitted per-step costs. The bundled model has only
    256 positions: for it, part (a) uses its shapes with 2048 positions and random weights
    (speed depends on shapes, not on what the weights learned).
(b) KV bytes = 2 x layers x kv_heads x head_dim x bytes x tokens, checked against a real
    `KVCache` allocation, and what grouped-query attention saves for SmolLM2-135M and
    Llama-3-8B shapes (pure arithmetic).
(c) minillm `generate` (as loaded, and with the decode weight layout of
    `minillm.model.layout`) vs transformers `generate(use_cache=True)` and `use_cache=False`
    on the model: same greedy tokens asserted, time ratios interleaved.
(d) Roofline: batch-1 cached decode of the model, bytes read per token x tokens/s vs the
    read bandwidth measured in the same run (`measure_roofline`: a sum over 512 MiB), as
    loaded, with the decode layout, and (on a CPU) compiled with frozen weights and
    max-autotune (`compile_decode_step(freeze=True)`: inductor's own GEMM kernels); where
    the eager step's time goes (`profile_split`), and the bandwidth of the matrix-vector
    products alone. `--llama-cpp` adds llama.cpp's batch-1 decode of the same weights (an
    f32 GGUF in llama-server), the peer. `--roofline` runs this part alone.

Every speed figure is a ratio of calls timed in alternation in the same run, or a
fraction of a ceiling measured in the same run: absolute times on a shared machine
are noise. The functions are importable: the chapter 02 notebook calls them with
smaller sizes.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import llama_cpp, report
from minillm import SamplingParams, generate, generate_naive, load_model, load_tokenizer
from minillm.cache import KVCache
from minillm.export.gguf import export_gguf
from minillm.generation.static import compile_decode_step
from minillm.lab import format_bytes, measure_roofline, paired_ratios, profile_split, time_samples
from minillm.model import (
    BUNDLED_DIR,
    ModelConfig,
    Tokenizer,
    Transformer,
    load_config,
    random_model,
)
from minillm.model.layout import decode_layout
from minillm.model.shapes import SMOLLM2_135M
from minillm.model.weights import resolve_device, resolve_dtype, resolve_model_dir
from minillm.training import first_divergence

ROOT = Path(__file__).resolve().parents[1]

SEED = 0
PROMPT = "And the LORD said unto Moses, Speak unto"  # the bundled model's (a KJV model)
CHAT = "Tell me about the history of Paris."  # a chat model's: a user message in its template

# Attention shapes only (layers, query heads, kv heads, head_dim): enough for KV bytes.
KV_SHAPES = {
    "SmolLM2-135M": (30, 9, 3, 64),
    "Llama-3-8B": (32, 32, 8, 128),
}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def model_name(name: str | None) -> str | None:
    """The `load_model` argument for a --model value: "bundled" (or None) is the bundled model."""
    return None if name in (None, "bundled") else name


def prompt_ids(tok: Tokenizer) -> list[int]:
    """The benchmark prompt: a user message in the model's chat template, or for a model
    without one (the bundled KJV model) the plain `PROMPT`."""
    if tok.chat_template is None:
        return tok.encode(PROMPT)
    return tok.apply_chat_template([{"role": "user", "content": CHAT}])


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
    params = greedy(total - prompt_len)
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


# ----------------------------------------------------------- (c) minillm vs transformers


def compare_hf(
    name: str | None = None,
    new_tokens: int = 200,
    repeats: int = 5,
    warmup: int = 1,
    uncached: bool = True,
    layout: bool | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> dict[str, Any]:
    """`new_tokens` greedy tokens (EOS disabled on both sides) from `prompt_ids`: time of
    transformers' generate (use_cache=True, and False) relative to minillm's generate, on
    model `name` (None: the bundled model) in `dtype` on `device` ("auto": bf16 on a GPU,
    fp32 on a CPU). `layout` (default: on a CPU) adds minillm with `decode_layout`, the
    weights stored [in, out] for the matrix-vector products of decode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model, tok = load_model(name, dtype=dtype, device=device), load_tokenizer(name)
    weight = model.lm_head.weight
    layout = weight.device.type == "cpu" if layout is None else layout
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(name), dtype=weight.dtype)
    hf = hf.to(weight.device).eval()
    hf.generation_config.eos_token_id = None  # generate exactly new_tokens, like ignore_eos
    ids = prompt_ids(tok)
    prompt = torch.tensor([ids], device=weight.device)
    out: dict[str, list[int]] = {}

    def ours(m: Transformer, label: str) -> Callable[[], None]:
        def call() -> None:
            out[label] = generate(m, [ids], greedy(new_tokens))[0]

        return call

    def theirs(use_cache: bool) -> Callable[[], None]:
        def call() -> None:
            with torch.inference_mode():
                gen = hf.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    use_cache=use_cache,
                    pad_token_id=0,
                )
            out[f"HF use_cache={use_cache}"] = gen[0, len(ids) :].tolist()

        return call

    fns = {"minillm": ours(model, "minillm")}
    if layout:
        fast = decode_layout(load_model(name, dtype=dtype, device=device))
        fns["minillm, decode layout"] = ours(fast, "layout")
    fns["HF use_cache=True"] = theirs(True)
    if uncached:
        fns["HF use_cache=False"] = theirs(False)
    samples = time_samples(fns, repeats=repeats, warmup=warmup)
    ratios = paired_ratios(samples, "minillm")
    same = all(out[k] == out["minillm"] for k in out)
    assert same, "minillm and transformers generated different tokens"
    assert len(out["minillm"]) == new_tokens
    return {
        "model": name or "bundled",
        "dtype": str(weight.dtype).removeprefix("torch."),
        "device": weight.device.type,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "same_tokens": same,
        "time_ratio": ratios,  # time / minillm's time
        "tokens_per_s": {k: new_tokens / statistics.median(v) for k, v in samples.items()},
    }


# ------------------------------------------------------------------------- (d) roofline

COMPILED = "compiled (frozen weights, max-autotune)"


def matvec_fn(model: Transformer) -> Callable[[], Any]:
    """The decode step's matrix-vector products alone: one row through every linear weight
    (the LM head included), back to back, no model code around them."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    first = weights[0]
    rows = {
        w.shape[1]: torch.randn(1, w.shape[1], dtype=first.dtype, device=first.device)
        for w in weights
    }

    @torch.inference_mode()
    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(rows[w.shape[1]], w)

    return run


def compiled_step_fn(model: Transformer, context: int) -> tuple[Callable[[], Any], float]:
    """(the step of `step_fns(model, context)["cached"]` compiled with frozen weights and
    max-autotune (`compile_decode_step(freeze=True)`), its compile seconds). A static
    cache of `context` slots, all attended (chapter 05's fixed shapes): the same work as
    the eager step's `context` filled slots."""
    ids = random_ids(model, context)
    weight = model.lm_head.weight
    cache = KVCache(model.config, 1, context, weight.dtype, weight.device)
    step = compile_decode_step("max-autotune-no-cudagraphs", freeze=True)
    last, pos = ids[:, context - 1 :], torch.tensor([[context - 1]], device=weight.device)
    with torch.inference_mode():
        cache.kv_len = context - 1
        if context > 1:
            model(ids[:, : context - 1], cache=cache)
        cache.kv_len = context
        t0 = time.perf_counter()
        step(model, cache, last, pos)
        compile_s = time.perf_counter() - t0

    @torch.inference_mode()
    def compiled() -> torch.Tensor:
        return step(model, cache, last, pos)

    return compiled, compile_s


def decode_roofline(
    model: Transformer | ModelConfig | dict[str, Any] = SMOLLM2_135M,
    context: int = 64,
    repeats: int = 10,
    copy_bytes: int = 512 * 2**20,
    split: bool = True,
    layout: bool | None = None,
    compiled: bool = False,
) -> dict[str, Any]:
    """Batch-1 cached decode at `context` tokens: tokens/s x bytes read per token (every
    weight once, plus the K/V read by attention) vs the read bandwidth measured here on a
    `copy_bytes` buffer (default: larger than any CPU cache: main memory), the best of a
    ceiling measurement and of reads timed in turn with the steps. `model`: a
    model, or a config for a random-weight one. `layout` (default: on a CPU) also times a
    copy with `decode_layout`'s weights; `compiled` also the step compiled with frozen
    weights and max-autotune (`compiled_step_fn`: minutes of compile on SmolLM2). Where
    the time goes: the matrix-vector products alone (`matvec_fn`) against the eager
    steps, and `profile_split` of the fastest eager step."""
    if not isinstance(model, Transformer):
        model = random_model(model)
    weight = model.lm_head.weight
    layout = weight.device.type == "cpu" if layout is None else layout
    models = {"as loaded": model}
    if layout:
        models["decode layout"] = decode_layout(copy.deepcopy(model))
    fns = {}
    for label, m in models.items():
        fns[label] = step_fns(m, context)["cached"]
        fns[f"{label}: matvecs"] = matvec_fn(m)
    compile_s = None
    if compiled:
        fns[COMPILED], compile_s = compiled_step_fn(model, context)
    roof = measure_roofline(weight.device, copy_bytes=copy_bytes)
    # The read bandwidth again, timed in turn with the steps: on a shared machine the bus
    # is busier at some moments than others, and the bound is the best read seen in the run.
    src = torch.empty(copy_bytes // 4, device=weight.device).uniform_()
    fns["read"] = src.sum
    samples = time_samples(fns, repeats=repeats, warmup=2)
    # Best of `repeats`, like the ceilings it is compared with (best of their runs): on a
    # shared machine a median mixes in other processes' use of the memory bus.
    best = {k: min(v) for k, v in samples.items()}
    read_Bps = max(roof.read_bytes_per_s, src.nbytes / best["read"])
    del src
    c = model.config
    weights = sum(p.nbytes for p in model.parameters())  # a tied embedding counts once
    kv = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 4) * context
    kv = kv * weight.element_size() // 4
    matvec_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_token = weights + kv
    bound_tps = read_Bps / per_token
    out: dict[str, Any] = {
        "params": model.num_parameters(),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "device": weight.device.type,
        "weight_bytes": weights,
        "kv_bytes_read": kv,
        "bytes_per_token": per_token,
        "bandwidth_Bps": roof.bytes_per_s,  # copy: (read + write) / s
        "read_Bps": read_Bps,
        "bound_tokens_per_s": bound_tps,
        "variants": {},
    }
    ratios = paired_ratios(samples, "as loaded")
    for label in [*models, *([COMPILED] if compiled else [])]:
        step_s = best[label]
        v = out["variants"][label] = {
            "tokens_per_s": 1 / step_s,
            "fraction_of_bound": (1 / step_s) / bound_tps,
            "achieved_Bps": per_token / step_s,
        }
        if label in models:
            mv_s = best[f"{label}: matvecs"]
            v["matvec_share"] = mv_s / step_s  # of a step's time: the products alone
            v["matvec_Bps"] = matvec_bytes / mv_s
        if label != "as loaded":
            v["speedup"] = 1 / ratios[label]
    if compiled:  # the same logits as the eager step (each call rewrites the same slot)
        diff = (fns[COMPILED]() - fns["as loaded"]()).abs().max().item()
        out["variants"][COMPILED] |= {"compile_s": compile_s, "max_abs_diff": diff}
    out["best"] = max(out["variants"], key=lambda k: out["variants"][k]["tokens_per_s"])
    top = out["variants"][out["best"]]
    out.update({k: top[k] for k in ("tokens_per_s", "fraction_of_bound", "achieved_Bps")})
    if split:
        eager = max(models, key=lambda k: out["variants"][k]["tokens_per_s"])
        out["split_of"] = eager
        s = profile_split(fns[eager], repeats=3, warmup=1)
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
    print(
        f"\n(c) {r['model']} ({r['dtype']}, {r['device']}), {r['prompt_tokens']}-token prompt, "
        f"{r['new_tokens']} new greedy tokens; same tokens: {r['same_tokens']}"
    )
    print(f"{'generator':<24} {'time / minillm':>15} {'tokens/s (this run)':>20}")
    for name, ratio in r["time_ratio"].items():
        print(f"{name:<24} {ratio:>14.2f}x {r['tokens_per_s'][name]:>20.1f}")


def print_roofline(r: dict[str, Any], name: str = "SmolLM2-135M") -> None:
    print(f"\n(d) roofline, {name}, batch-1 cached decode, {r['dtype']}, {r['device']}")
    print(f"  bytes read per token: {format_bytes(r['bytes_per_token'])} ", end="")
    print(f"(weights {format_bytes(r['weight_bytes'])} + KV {format_bytes(r['kv_bytes_read'])})")
    print(f"  measured read bandwidth: {r['read_Bps'] / 1e9:.1f} GB/s", end="")
    print(
        f" (copy: {r['bandwidth_Bps'] / 1e9:.1f} GB/s) -> bound {r['bound_tokens_per_s']:.1f} tok/s"
    )
    for label, v in r["variants"].items():
        gain = f", {v['speedup']:.2f}x as loaded" if "speedup" in v else ""
        print(
            f"  {label + ':':<15} {v['tokens_per_s']:.1f} tok/s = "
            f"{v['achieved_Bps'] / 1e9:.1f} GB/s = {v['fraction_of_bound']:.0%} of the bound{gain}"
        )
        if "matvec_Bps" in v:
            print(
                f"    matrix-vector products alone {v['matvec_share']:.0%} of the step, at "
                f"{v['matvec_Bps'] / 1e9:.1f} GB/s "
                f"({v['matvec_Bps'] / r['read_Bps']:.0%} of the read bandwidth)"
            )
        if "compile_s" in v:
            print(
                f"    compiled in {v['compile_s']:.0f} s (a GEMM kernel timed and kept per shape);"
                f" logits within {v['max_abs_diff']:.1e} of the eager step's"
            )
    if "peer" in r:
        p = r["peer"]
        print(
            f"  {p['name']}: {p['tokens_per_s']:.1f} tok/s = {p['fraction_of_bound']:.0%} of the "
            f"bound (best of {len(p['rounds'])}); minillm's best is {p['minillm_vs_peer']:.2f}x it"
        )
    if "split" in r:
        parts = ", ".join(f"{k} {v:.0%}" for k, v in r["split"].items())
        print(f"  where an eager step's time goes ({r['split_of']}, profiler): {parts}")


def llama_cpp_peer(
    model: Transformer, name: str | None, roof: dict[str, Any], context: int, rounds: int
) -> dict[str, Any]:
    """llama.cpp decoding `model`'s checkpoint `name` (written as an f32 GGUF) at batch 1,
    with this process's thread count: `context` tokens after a prompt of context/2, on
    average the roofline step's context. Best of `rounds`, like the variants."""
    with tempfile.TemporaryDirectory() as tmp:
        gguf = export_gguf(resolve_model_dir(name), Path(tmp) / "model-f32.gguf")
        prompt = random_ids(model, context // 2)[0].tolist()
        speeds = llama_cpp.decode_tokens_per_s(
            gguf, prompt, context, rounds, threads=torch.get_num_threads()
        )
    best = max(speeds)
    return {
        "name": "llama.cpp f32 (llama-server, 1 slot)",
        "tokens_per_s": best,
        "rounds": speeds,
        "fraction_of_bound": best / roof["bound_tokens_per_s"],
        "minillm_vs_peer": roof["tokens_per_s"] / best,
    }


def roofline_summary(r: dict[str, Any]) -> str:
    v = r["variants"]
    text = (
        "decode at "
        + ", ".join(f"{v[k]['fraction_of_bound']:.0%} ({k})" for k in v)
        + f" of the read-bandwidth bound ({r['bound_tokens_per_s']:.1f} tok/s)"
    )
    if "peer" in r:
        p = r["peer"]
        text += (
            f"; {p['name']} {p['fraction_of_bound']:.0%}: minillm ({r['best']}) at "
            f"{p['minillm_vs_peer']:.2f}x its speed"
        )
    return text


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="smaller sizes (a few minutes)")
    ap.add_argument(
        "--model", default="smollm2", help="smollm2 (default), bundled, or a checkpoint"
    )
    ap.add_argument(
        "--e2e",
        default=None,
        help="total lengths for the end-to-end measurement, e.g. 256,1024 (default: 256,1024; "
        "--quick: 256). 1024 on SmolLM2 takes most of an hour (the naive loop)",
    )
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on a CPU), ...")
    ap.add_argument(
        "--roofline",
        action="store_true",
        help="only part (d), with the compiled step on a CPU (a few minutes on SmolLM2)",
    )
    ap.add_argument(
        "--llama-cpp",
        action="store_true",
        help="(d) also times llama.cpp's batch-1 decode of the same weights as an f32 GGUF "
        "(needs llama-server: python -m benchmarks.llama_server)",
    )
    args = ap.parse_args(argv)
    run = report.start(f"kv-cache ({args.model})", args, seed=SEED)
    # Inductor caches compiled code and max-autotune's kernel choices on disk: a rerun
    # would reuse choices timed on another run's machine state, and its compile time
    # would be a cache lookup.
    torch.compiler.config.force_disable_caches = True
    name = model_name(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    print(f"model {args.model}, {str(dtype).removeprefix('torch.')} on {device.type}")
    if args.quick:
        lengths, e2e_lengths, predict_at, new_tokens, ctx = [64, 256, 512], [256], [1024], 64, 32
    else:
        lengths, e2e_lengths = [64, 128, 256, 512, 1024, 2048], [256, 1024]
        predict_at, new_tokens, ctx = [1024, 2048], 200, 64
    if args.e2e:
        e2e_lengths = [int(n) for n in args.e2e.split(",")]
    longest = max(*lengths, *predict_at, *e2e_lengths)
    model = load_model(name, dtype=dtype, device=device)
    if model.config.max_position_embeddings < longest:  # the bundled model: 256 positions
        model_a = long_context_model(longest).to(device=device, dtype=dtype)
        label_a = f"{args.model} shapes, random weights, {longest} positions"
    else:
        model_a, label_a = model, args.model
    print(f"(a) and the roofline on: {label_a}")

    cpu = device.type == "cpu"
    roof = decode_roofline(model, context=ctx, repeats=5 if args.quick else 10, compiled=cpu)
    if args.llama_cpp:
        roof["peer"] = llama_cpp_peer(model, name, roof, ctx, rounds=3 if args.quick else 5)
    print_roofline(roof, args.model)
    if args.roofline:
        return run.finish({"model": args.model, "roofline": roof}, roofline_summary(roof))

    hf = compare_hf(name, new_tokens, repeats=3 if args.quick else 5, device=device, dtype=dtype)
    print_hf(hf)

    costs = step_costs(model_a, lengths, repeats=3 if args.quick else 5)
    print_steps(costs)
    e2e = []
    for n in e2e_lengths:  # one pair each for the real model: the naive loop is the hour
        e2e.append(end_to_end(model_a, n, repeats=2 if model_a is not model else 1))
        print_e2e(e2e[-1:], {})
    predicted = {n: predicted_totals(costs, 16, n) for n in sorted({*e2e_lengths, *predict_at})}
    print_e2e(e2e, predicted)

    tokens = 8192
    gqa, alloc = gqa_table(tokens), kv_allocation_check()
    print_gqa(gqa, alloc, tokens)

    results = {
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "model_a": label_a,
        "step_costs": costs,
        "end_to_end": e2e,
        "predicted": predicted,
        "gqa": gqa,
        "kv_allocation": alloc,
        "hf": hf,
        "roofline": roof,
    }
    measured = e2e[-1]
    pred = predicted[predict_at[-1]]
    ratios = hf["time_ratio"]
    summary = (
        f"speedup {measured['speedup']:.1f}x at "
        f"{measured['total']} tokens (measured), {pred['speedup']:.1f}x at {predict_at[-1]} "
        f"(predicted); step at {lengths[-1]}: {costs['ratio'][-1]:.1f}x; HF use_cache=True "
        f"takes {ratios['HF use_cache=True']:.2f}x minillm's time"
    )
    if "HF use_cache=False" in ratios:
        summary += f", use_cache=False {ratios['HF use_cache=False']:.2f}x"
    if "minillm, decode layout" in ratios:
        summary += f", minillm with the decode layout {ratios['minillm, decode layout']:.2f}x"
    summary += (
        f"; GQA saves {gqa[0]['saving']:.0f}x (SmolLM2-135M), {gqa[1]['saving']:.0f}x "
        f"(Llama-3-8B); {roofline_summary(roof)}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    return run.finish(results, summary)


if __name__ == "__main__":
    main()
