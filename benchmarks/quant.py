"""Chapter 06 benchmark: what each weight format costs in quality, saves in bytes, and does
to decode speed, on this machine, in one run.

    python -m benchmarks.quant [--quick] [--windows N] [--threads N] [--no-ort] [--json out.json]
    python -m benchmarks.quant --q4-1 [--windows N]     # part (d) alone

(a) Bundled model (trained, so perplexity means something): for fp32, bf16, our INT8 /
    INT4 / NF4 schemes and the libraries (bitsandbytes 8-bit and NF4, torch.ao dynamic
    int8, ONNX Runtime dynamic int8): weight bytes of the linear layers and of the whole
    model, held-out perplexity and its change vs fp32, next-token agreement with fp32,
    and the time of one cached decode step as a ratio to fp32 (A/B interleaved;
    `minillm.bench.quant.quality_table`).
(b) SmolLM2-135M shapes, random weights (speed and bytes do not depend on what the
    weights learned): weight bytes for every scheme, and decode-step time ratios vs fp32
    (`minillm.bench.quant.realistic_table`). Here the linear layers are 80% of the weights,
    as in real checkpoints; in the bundled model the tied 4096 x 128 embedding is 40% and
    is kept in fp32 (see quantize_model).
(c) The fused INT4 kernel on a GPU: `python -m benchmarks.kernels`.
(d) `--q4-1`: SmolLM2-135M-Instruct, whose published weights went through Q4_1: each
    scheme against the dequantized fp32 as the reference (Factbook and KJV perplexity,
    next-token agreement, weight error): re-quantizing to INT4 g32 lands near Q4_1's own
    grid, so it says little about what INT4 costs a model (`minillm.bench.q4_1`).

The last line is one `SUMMARY quant:` line. Speed figures are ratios of calls timed in
alternation in the same run: absolute times on a shared machine are noise.
"""

from __future__ import annotations

from typing import Any

from benchmarks import report
from minillm import load_model
from minillm.bench import q4_1
from minillm.bench import quant as bench

# 576 = 9 x 64: group 128 does not divide SmolLM2's hidden size (quantize_int4 says so)
BIG_SCHEMES = ["fp32", "bf16", "int8", "int4-g64", "int4sym-g64", "int4-g32", "nf4-g64"]
BIG_SCHEMES += ["nf4-g64-dq", "torch.ao-int8", "bnb-int8", "bnb-nf4-g64"]


def summary(quality: list[dict[str, Any]], big: list[dict[str, Any]]) -> str:
    """One line: the goals of the chapter, each with its figure."""
    q = {r["scheme"]: r for r in quality if "ppl" in r}
    b = {r["scheme"]: r for r in big}
    parts = [f"int8 ppl {100 * q['int8']['ppl_delta']:+.2f}%"]
    for g in (128, 64, 32):
        if f"nf4-g{g}" in q and f"int4-g{g}" in q:
            parts.append(
                f"g{g} ppl nf4 {q[f'nf4-g{g}']['ppl']:.2f} / int4 {q[f'int4-g{g}']['ppl']:.2f}"
                + (f" / int4sym {q[f'int4sym-g{g}']['ppl']:.2f}" if f"int4sym-g{g}" in q else "")
            )
    parts.append(
        f"135M linear bytes int8 {b['int8']['linear_reduction']:.2f}x, "
        f"int4-g64 {b['int4-g64']['linear_reduction']:.2f}x, "
        f"nf4-g64-dq {b['nf4-g64-dq']['linear_reduction']:.2f}x less"
    )
    speed = ", ".join(
        f"{s} {b[s]['step_ratio']:.2f}" for s in bench.SPEED_BIG if b.get(s, {}).get("step_ratio")
    )
    parts.append(f"135M decode step time / fp32: {speed}")
    return "; ".join(parts)


def q4_1_summary(caveat: dict[str, Any]) -> str:
    """One line: how much of each 4-bit g32 scheme's weights Q4_1's grid already holds."""
    by = {row["scheme"]: row for row in caveat["rows"]}
    return "; ".join(
        f"{k} {by[k]['unchanged']:.1%} of weights unchanged, rel RMS "
        f"{by[k]['rel_rms']:.4f} (Q8_0 embedding {by[k]['control_rel_rms']:.4f}), "
        f"perplexity {100 * by[k]['d_factbook']:+.2f}% Factbook / "
        f"{100 * by[k]['d_kjv']:+.2f}% KJV"
        for k in ("q4_1-g32", "int4-g32", "nf4-g32")
        if k in by
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer windows and timing rounds")
    ap.add_argument("--windows", type=int, default=None, help="held-out windows (default all)")
    ap.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime int8")
    ap.add_argument(
        "--q4-1",
        action="store_true",
        help="only part (d): SmolLM2's Q4_1 weights re-quantized, vs the dequantized fp32",
    )
    args = ap.parse_args(argv)
    if args.q4_1:
        run = report.start("quant q4_1", args)
        print("(d) SmolLM2-135M-Instruct (shipped as Q4_1): every scheme vs the dequantized fp32")
        caveat = q4_1.q4_1_caveat(windows=args.windows or (4 if args.quick else 8))
        q4_1.print_q4_1(caveat)
        return run.finish(caveat, q4_1_summary(caveat))
    run = report.start("quant", args)
    windows = args.windows or (16 if args.quick else None)
    repeats = 5 if args.quick else 15
    print(f"held-out windows: {windows or 'all'}")
    print("\n(a) bundled model: quality, bytes, decode-step time vs fp32 (lm_head kept fp32)")
    schemes = ["fp32", "bf16", *bench.OURS, *bench.LIBRARIES]
    quality = bench.quality_table(schemes, windows, repeats, use_ort=not args.no_ort)
    bench.print_quality(quality)
    _, ao_note = bench.torch_ao_int8(load_model())
    print(f"torch.ao.quantization.quantize_dynamic warns: {ao_note!r}")

    print("\n(b) SmolLM2-135M shapes, random weights: bytes; decode-step time vs fp32")
    big = bench.realistic_table(BIG_SCHEMES, bench.SPEED_BIG, max(3, repeats // 3))
    bench.print_realistic(big)
    print("\n(c) the fused INT4 kernel on a GPU: python -m benchmarks.kernels (and make gpu-check)")
    return run.finish({"quality": quality, "realistic": big}, summary(quality, big))


if __name__ == "__main__":
    main()
