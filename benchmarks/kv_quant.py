"""KV-cache quantization (chapters 06 and 07): memory gained, quality lost.

    python -m benchmarks.kv_quant [--model smollm2] [--quick] [--threads N] [--json out.json]

Formats (`kv_cache_dtype`, `minillm.cache.kv_quant`): int8, fp8 (e4m3) and fp8_e5m2, one
fp32 scale per token and kv head; the reference is the cache in the model's own dtype.

(a) Memory: bytes per token for the model's shapes, and how many requests run at once
    when the KV budget of chapter 07's simulator (`benchmarks.paged`: its 1000-request
    ShareGPT-like trace, blocks of 16) holds bf16 K/V or the same bytes of quantized K/V.
    Exact counting, no timing.
(b) Quality on the real model: perplexity over the Factbook text (every attention read
    goes through the quantized cache: the window is one forward that writes, then reads
    back, its own K/V), and greedy generations from several prompts, `--tokens` long, with
    each format against the unquantized cache: where the first token differs, and the
    share of prompts whose whole generation is identical.

The last line is one `SUMMARY kv-quant:` line.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks import report
from benchmarks.paged import BUDGET, make_trace, simulate
from minillm import SamplingParams, load_model, load_tokenizer
from minillm.cache import KVCache
from minillm.cache.kv_quant import KV_CACHE_DTYPES
from minillm.engine.memory import kv_bytes_per_block
from minillm.generation.cached import decode, eager_decode_step, prefill
from minillm.model import ModelConfig, Transformer
from minillm.training import factbook_ids, first_divergence, perplexity

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
SEED = 0


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
    print(f"\n(a) memory: {requests}-request trace, KV budget = {BUDGET} bf16 token slots")
    print(f"{'format':<10}{'B/token':>9}{'x bf16':>8}{'slots':>8}{'running':>9}{'preempt':>9}")
    for r in rows:
        print(
            f"{r['format']:<10}{r['bytes_per_token']:>9}{r['vs_bf16']:>8.2f}{r['slots']:>8}"
            f"{r['mean_running']:>9.1f}{r['preemptions']:>9}"
        )


def cached_logits(model: Transformer, kv_cache_dtype: str):
    """logits_fn for `perplexity`: one forward through a fresh cache of that format."""
    device = model.lm_head.weight.device

    def fn(ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        cache = KVCache(model.config, b, t, model.lm_head.weight.dtype, device, kv_cache_dtype)
        return model(ids.to(device), cache=cache)

    return fn


@torch.inference_mode()
def greedy(model: Transformer, prompts: list[list[int]], n: int, kv_cache_dtype: str):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    cache, logits, positions = prefill(model, prompts, n, kv_cache_dtype)
    return decode(model, cache, logits, positions, params, eager_decode_step)


def quality_table(
    model: Transformer, ids: torch.Tensor, window: int, windows: int, prompts, tokens: int
) -> list[dict[str, Any]]:
    ref_ppl = perplexity(cached_logits(model, "auto"), ids, window, 4, windows)
    ref_out = greedy(model, prompts, tokens, "auto")
    rows = [{"format": "reference", "ppl": ref_ppl, "ppl_delta": 0.0}]
    for name in FORMATS:
        ppl = perplexity(cached_logits(model, name), ids, window, 4, windows)
        out = greedy(model, prompts, tokens, name)
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
    print(f"\n(b) quality (reference: K/V in {ref_dtype}); greedy over {tokens} tokens")
    print(f"{'format':<10}{'ppl':>9}{'delta':>9}{'first diff (median)':>21}{'identical':>11}")
    for r in rows:
        tail = ""
        if "identical" in r:
            tail = f"{r['first_divergence_median']:>21.0f}{r['identical']:>11.0%}"
        print(f"{r['format']:<10}{r['ppl']:>9.3f}{r['ppl_delta']:>+9.2%}{tail}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer windows and tokens (~30 s)")
    ap.add_argument("--model", default="smollm2", help="model name or directory (smollm2)")
    ap.add_argument("--tokens", type=int, help="greedy tokens per prompt (256; quick 96)")
    args = ap.parse_args(argv)
    run = report.start("kv-quant", args, seed=SEED)
    model = load_model(args.model, dtype="auto", device="auto")
    tok = load_tokenizer(args.model)
    cfg = model.config
    requests, windows = (300, 4) if args.quick else (1000, 16)
    tokens = args.tokens or (96 if args.quick else 256)
    print(f"{args.model} on {model.lm_head.weight.device}")

    memory = memory_table(cfg, requests)
    print_memory(memory, requests)

    ids = factbook_ids(tok)
    starts = range(0, 8 * 997, 997)[: 4 if args.quick else 8]  # prompts from across the text
    prompts = [ids[s : s + 24].tolist() for s in starts]
    quality = quality_table(model, ids, 512, windows, prompts, tokens)
    print_quality(quality, tokens, model.lm_head.weight.dtype)

    results = {
        "model": args.model,
        "memory": memory,
        "quality": quality,
        "windows": windows,
        "tokens": tokens,
    }
    mem = {r["format"]: r for r in memory}
    q = {r["format"]: r for r in quality}
    summary = (
        f"{args.model}; int8 K/V {mem['int8']['vs_bf16']:.2f}x fewer bytes "
        f"than bf16, requests running at once {mem['bf16']['mean_running']:.1f} -> "
        f"{mem['int8']['mean_running']:.1f}; perplexity delta int8 {q['int8']['ppl_delta']:+.2%}, "
        f"fp8_e4m3 {q['fp8_e4m3']['ppl_delta']:+.2%}, fp8_e5m2 {q['fp8_e5m2']['ppl_delta']:+.2%}; "
        f"greedy identical over {tokens} tokens: int8 {q['int8']['identical']:.0%}, "
        f"e4m3 {q['fp8_e4m3']['identical']:.0%}, e5m2 {q['fp8_e5m2']['identical']:.0%}"
    )
    return run.finish(results, summary)


if __name__ == "__main__":
    main()
