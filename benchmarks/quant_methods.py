"""Chapter 06 benchmark: the quantization methods production uses, built from scratch and
scored by one evaluator in one table: RTN -> GPTQ -> AWQ (INT4), W8A8 with and without
SmoothQuant, FP8; plus the activation outliers of the model that motivate W8A8's trouble.

    python -m benchmarks.quant_methods [--model bundled] [--group G] [--windows N]
                                       [--eval kjv|factbook] [--only NAME ...]
                                       [--quick] [--threads N] [--json out.json]

SmoothQuant rows for each `--alphas` value (default 0.5 and 0.8), and with alpha searched
per scale group (`search_smooth_model`); W8A8 activations per tensor, per token, and per
token with a zero point ('per-token-asym', `fake_quant_activations`). AWQ scores its
scales on the output of the module they feed (the paper's way); the '(per-linear loss)'
row scores each linear's own output; the '(duo scaling)' row searches AutoAWQ's scales,
activations and weights together.
`--only`: just the rows whose name contains one of the words (fp32 and RTN always run).

`--model`: 'bundled' (default; trained, so perplexity means something), a local HF
directory, or 'smollm2'. Calibration: KJV *training* text (`calibration_batches`); scoring:
the held-out KJV text (`held_out_ids`, default) or modern English (`--eval factbook`,
`factbook_ids`), both through the model's own tokenizer. G: int4 group size (default: the
largest of 128/64/32 dividing every layer's input; SmolLM2's 576 takes 64).

Columns: bytes of the quantized linear weights (lm_head kept in fp32 everywhere), held-out
perplexity and its change vs fp32, next-token agreement with fp32 (top-1, teacher-forced),
and the decode-step speed of the row's storage format vs fp32 at batch 1 (A/B interleaved
in this run; INT8 / INT4 on torch's CPU kernels; '-' where the format has no CPU kernel
and is simulated: W8A8 and FP8 need int8 / fp8 GEMMs this CPU path does not have).
"""

from __future__ import annotations

from typing import Any

from benchmarks import report
from minillm import load_model, load_tokenizer
from minillm.bench import quant_methods as bench
from minillm.bench.quant_decode import group_size_for
from minillm.quant.calibrate import calibration_batches


def summary(result: dict[str, Any]) -> str:
    """The SUMMARY line over the rows that ran."""
    rows, g = result["rows"], result["group"]
    rtn = f"RTN int4 g{g}"
    parts = [f"int4 g{g} ppl delta RTN {100 * rows[rtn]['ppl_delta']:+.2f}%"]
    awqs = [f"AWQ int4 g{g}{v}" for v in ("", " (per-linear loss)", " (duo scaling)")]
    for method in (f"GPTQ int4 g{g}", *awqs):
        if method in rows:
            parts.append(
                f"{method.split(' int4')[0]}{method.split(f'g{g}')[1]} "
                f"{100 * rows[method]['ppl_delta']:+.2f}% "
                f"(recovers {bench.recovered(rows, method, rtn):.0%})"
            )
    for act in ("per-tensor", "per-token", "per-token-asym"):
        smooth = [k for k in rows if k.startswith("SmoothQuant") and k.endswith(act)]
        if f"W8A8 {act}" in rows and smooth:
            best = min(smooth, key=lambda k: rows[k]["ppl"])
            parts.append(
                f"W8A8 {act} {100 * rows[f'W8A8 {act}']['ppl_delta']:+.2f}% -> {best} "
                f"{100 * rows[best]['ppl_delta']:+.2f}%"
            )
    if "FP8 e4m3 W(ch)+A(tensor)" in rows:
        parts.append(f"FP8 e4m3 {100 * rows['FP8 e4m3 W(ch)+A(tensor)']['ppl_delta']:+.2f}%")
    parts.append(f"outlier ratio max {result['outliers']['max_ratio']:.0f}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer windows and timing rounds")
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--group", type=int, default=None, help="int4 group size")
    ap.add_argument(
        "--alphas", type=float, nargs="+", default=[0.5, 0.8], help="SmoothQuant's strengths"
    )
    ap.add_argument("--windows", type=int, default=None, help="held-out windows of 256 tokens")
    ap.add_argument("--eval", choices=sorted(bench.EVAL_TEXTS), default="kjv", help="scoring text")
    ap.add_argument("--calib", type=int, default=4, help="calibration batches of 4 x 256 tokens")
    ap.add_argument("--only", nargs="+", default=None, help="rows whose name has one of these")
    ap.add_argument(
        "--awq-tokens", type=int, default=None, help="calibration tokens AWQ scores each scale on"
    )
    args = ap.parse_args(argv)
    run = report.start(f"quant_methods {args.model}", args)
    name = None if args.model == "bundled" else args.model
    base, tok = load_model(name), load_tokenizer(name)
    g = args.group or group_size_for(base)
    n_windows = args.windows or (8 if args.quick else 32)
    print(
        f"model {args.model}, {n_windows} {args.eval} windows of {bench.WINDOW} tokens, "
        f"{args.calib} x 4 x 256 calibration tokens"
    )
    batches = calibration_batches(tok, n_batches=args.calib, batch_size=4, seq_len=256)
    x, y = bench.windows(bench.EVAL_TEXTS[args.eval](tok), n_windows)
    stats = bench.outliers(base, batches)
    speed = bench.format_speed(base, g, 3 if args.quick else 9)
    chosen = {
        label: entry
        for label, entry in bench.methods(
            g, args.alphas, {"max_tokens": args.awq_tokens} if args.awq_tokens else None
        ).items()
        if args.only is None
        or label in ("fp32", f"RTN int4 g{g}")
        or any(word in label for word in args.only)
    }
    print()
    rows = bench.evaluate(base, batches, x, y, chosen, speed)
    result = {
        "model": args.model,
        "group": g,
        "eval": args.eval,
        "windows": len(x),
        "calibration_tokens": sum(b.numel() for b in batches),
        "outliers": stats,
        "rows": rows,
    }
    return run.finish(result, summary(result))


if __name__ == "__main__":
    main()
