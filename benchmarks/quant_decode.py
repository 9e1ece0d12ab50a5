"""Chapter 06 benchmark: fewer weight bytes become faster decoding, on this CPU, when a
kernel reads the quantized weights directly (torch's int8 / int4 CPU kernels).

    python -m benchmarks.quant_decode [--model SmolLM2-135M] [--batch 1 8] [--context 64]
                                      [--quick] [--threads N] [--json out.json]

`--model`: a shape name of `minillm.model.shapes` (random weights: speed depends on shapes,
not on what the weights learned; the default), 'bundled', or anything `load_model` takes
(a local HF directory, 'smollm2' once that model name exists).

For each batch size: one cached decode step (batch rows, `--context` tokens already in the
cache) timed A/B interleaved against fp32 in the same run, for

    fp32, bf16                   the model's dtype
    int8, int4-gG                QuantLinear on torch's CPU kernels (bf16 activations),
                                 lm_head kept in fp32 (it is the tied embedding)
    int8+head, int4-gG+head      the same with the lm_head quantized too (a second, small
                                 copy of the embedding: what llama.cpp's Q4 files do)
    int4-gG dequant              chapter 06's QuantLinear: rebuild fp32 W at every call

and reports decode tok/s as a ratio to fp32 (> 1: faster), the weight bytes one step
reads, and where each variant's time goes (`profile_split`, `kernel_shares`). G is the
largest of 128 / 64 / 32 that divides every layer's input size. The measuring code is
`minillm.bench.quant_decode`. One SUMMARY line.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import report
from minillm.bench import quant_decode as bench


def summary(results: dict[int, dict[str, Any]]) -> str:
    """One line: each format's decode speed vs fp32, per batch size."""
    parts = []
    for batch, rows in results.items():
        speed = ", ".join(f"{n} {r['speedup']:.2f}x" for n, r in rows.items() if n != "fp32")
        parts.append(f"batch {batch}: {speed}")
    return "decode tok/s vs fp32: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> dict[int, dict[str, Any]]:
    ap = report.parser(__doc__, quick="fewer timing rounds")
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=64, help="tokens in the cache")
    args = ap.parse_args(argv)
    run = report.start(f"quant_decode {args.model}", args)
    # The kernels' speed depends on the CPU (AVX2 vs AVX512: the int8/int4 ratios differ
    # by 1.5x between two CPUs here), so the run prints it and its JSON records it.
    print(f"model {args.model}, context {args.context}, ", end="")
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    models = bench.variants(bench.load(args.model))
    repeats = 5 if args.quick else 15
    results = {}
    for batch in args.batch:
        results[batch] = bench.measure(models, batch, args.context, repeats)
        bench.print_rows(results[batch], batch)
    run.finish({str(b): r for b, r in results.items()}, summary(results))
    return results


if __name__ == "__main__":
    main()
