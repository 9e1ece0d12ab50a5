"""Chapter 04 benchmark: what TensorRT does, built small and measured on the bundled model.

    python -m benchmarks.calibration [--quick] [--threads N] [--json results.json]

(a) INT8 calibration: activation statistics of every nn.Linear input on batches of the
    bundled model's training text; the clipping thresholds max / percentile (99.99) /
    entropy (KL) pick for each layer's down_proj input (the heavy-tailed one); held-out
    perplexity and next-token agreement with fp32 of fp32, int8 weights only, and int8
    weights + activations calibrated by each method (fake quantization: int8's error, fp32
    speed).
(b) Layer fusion: norm weights folded into the next linears, QKV and gate/up fused. Logits
    equal (max |diff|), greedy tokens identical, aten ops per forward before and after,
    and the fused/unfused time ratio of a 128-token prefill and a one-token decode step
    with a KV cache (A/B interleaved, median of paired ratios, 1 thread by default).
(c) The same fusion timing on a SmolLM2-135M-shaped model with random weights (576 wide,
    30 layers): does a realistic width change the answer? (Skipped with --quick.)
(d) Explicit quantization, as TensorRT 10+ takes INT8: the percentile and max scales of (a)
    written into the model's ONNX graph as Q/DQ pairs (and the max graph turned into FP8
    e4m3), run on ONNX Runtime's CPU provider: perplexity, agreement with fp32, and
    agreement with our own fake quantization of the same scales.

The last line is one `SUMMARY calibration:` line. Speed figures are ratios measured in the
same run; quality figures are deterministic for a given calibration set. The measurements
are `minillm.bench.calibration`, which the chapter 04 notebook calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks import report
from minillm.bench import calibration as bench


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="smaller sizes (about 30 s)")
    args = ap.parse_args(argv)
    run = report.start("calibration", args)

    cal = bench.calibration(**({"n_batches": 4, "max_windows": 16} if args.quick else {}))
    bench.print_calibration(cal)
    fus = bench.fusion(repeats=10 if args.quick else 30)
    bench.print_fusion(fus)

    results = {"calibration": cal, "fusion": fus}
    if not args.quick:
        results["fusion_135m"] = wide = bench.fusion_at_width()
        bench.print_width(wide)
    q = cal["quality"]
    ppl = ", ".join(f"{k.removeprefix('int8 ')} {v['perplexity']:.2f}" for k, v in q.items())
    agree = ", ".join(
        f"{k.removeprefix('int8 ')} {v['agreement']:.1%}" for k, v in q.items() if k != "fp32"
    )
    qdq = ", ".join(f"{k} {v['perplexity']:.2f}" for k, v in cal["explicit_qdq"].items())
    o = fus["ops"]
    s = fus["time_fused_over_unfused"]
    summary = (
        f"perplexity {ppl}; agreement with fp32 {agree}; Q/DQ graphs on ORT: perplexity {qdq}; "
        f"fusion: logits max diff {fus['max_abs_diff']:.1g}, same tokens "
        f"{fus['same_greedy_tokens']}, compute ops per forward {o['unfused']['compute_ops']} -> "
        f"{o['fused']['compute_ops']} (GEMMs {o['unfused']['gemms']} -> {o['fused']['gemms']}), "
        f"time fused/unfused prefill {s['prefill']:.2f}x, decode {s['decode']:.2f}x"
    )
    if "fusion_135m" in results:
        w = results["fusion_135m"]["time_fused_over_unfused"]
        summary += f" (135M shape: prefill {w['prefill']:.2f}x, decode {w['decode']:.2f}x)"
    return run.finish(results, summary)


if __name__ == "__main__":
    main()
