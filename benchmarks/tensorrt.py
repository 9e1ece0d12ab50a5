"""Chapter 04 on a GPU: eager fp16, torch.compile, torch-tensorrt and ONNX Runtime's CUDA and
TensorRT providers on the same token ids, against eager fp32 (logit error, argmax agreement,
time ratio). Needs an NVIDIA GPU with torch-tensorrt and onnxruntime-gpu.

    python -m benchmarks.tensorrt [--model DIR] [--threads N] [--json out.json]

The last line is one `SUMMARY tensorrt:` line: each backend at the largest shape. The
measurements are `minillm.bench.tensorrt` (`compare_backends`, `multi_stream_ratio`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks import report
from minillm.bench import tensorrt as bench
from minillm.model import load_model


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: bundled)")
    args = ap.parse_args(argv)
    run = report.start("tensorrt", args)
    result = bench.compare_backends(load_model(args.model))
    for row in result["rows"]:
        print(
            f"{row['backend']:<22} {str(row['shape']):<10} max|diff| {row['max_abs_diff']:.2e} "
            f"argmax {row['argmax_agreement']:.0%} time {row['time_vs_eager_fp32']:.2f}x"
        )
    for name, err in result["errors"].items():
        print(f"{name}: failed: {err}")
    return run.finish(result, summary(result))


def summary(result: dict[str, Any]) -> str:
    """The SUMMARY text: each backend's time ratio and argmax agreement at the largest
    (batch, seq), then the backends that failed to build."""
    largest = max((tuple(r["shape"]) for r in result["rows"]), key=lambda s: s[0] * s[1])
    at = [
        r for r in result["rows"] if tuple(r["shape"]) == largest and r["backend"] != "eager fp32"
    ]
    text = f"{result['gpu']}, shape {largest}, time vs eager fp32 (argmax agreement): " + (
        ", ".join(
            f"{r['backend']} {r['time_vs_eager_fp32']:.2f}x ({r['argmax_agreement']:.0%})"
            for r in at
        )
        or "no backend built"
    )
    if result["errors"]:
        text += "; failed: " + ", ".join(result["errors"])
    return text


if __name__ == "__main__":
    main()
