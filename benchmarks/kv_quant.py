"""KV-cache quantization (chapters 06 and 07): memory gained, quality lost.

    python -m benchmarks.kv_quant [--model smollm2] [--quick] [--threads N] [--json out.json]

Formats (`kv_cache_dtype`, `minillm.cache.kv_quant`): int8, fp8 (e4m3) and fp8_e5m2, one
fp32 scale per token and kv head; the reference is the cache in the model's own dtype.

(a) Memory: bytes per token for the model's shapes, and how many requests run at once
    when the KV budget of chapter 07's simulator (`minillm.bench.paged`: its 1000-request
    ShareGPT-like trace, blocks of 16) holds bf16 K/V or the same bytes of quantized K/V.
    Exact counting, no timing.
(b) Quality on the real model: perplexity over the Factbook text (every attention read
    goes through the quantized cache: the window is one forward that writes, then reads
    back, its own K/V), and greedy generations from several prompts, `--tokens` long, with
    each format against the unquantized cache: where the first token differs, and the
    share of prompts whose whole generation is identical.

The measuring code is `minillm.bench.kv_quant`. The last line is one `SUMMARY kv-quant:` line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks import report
from minillm import load_model, load_tokenizer
from minillm.bench import kv_quant as bench
from minillm.training import factbook_ids


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer windows and tokens (~30 s)")
    ap.add_argument("--model", default="smollm2", help="model name or directory (smollm2)")
    ap.add_argument("--tokens", type=int, help="greedy tokens per prompt (256; quick 96)")
    args = ap.parse_args(argv)
    run = report.start("kv-quant", args)
    model = load_model(args.model, dtype="auto", device="auto")
    tok = load_tokenizer(args.model)
    cfg = model.config
    requests, windows = (300, 4) if args.quick else (1000, 16)
    tokens = args.tokens or (96 if args.quick else 256)
    print(f"{args.model} on {model.lm_head.weight.device}")

    memory = bench.memory_table(cfg, requests)
    bench.print_memory(memory, requests)

    ids = factbook_ids(tok)
    starts = range(0, 8 * 997, 997)[: 4 if args.quick else 8]  # prompts from across the text
    prompts = [ids[s : s + 24].tolist() for s in starts]
    quality = bench.quality_table(model, ids, 512, windows, prompts, tokens)
    bench.print_quality(quality, tokens, model.lm_head.weight.dtype)

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
