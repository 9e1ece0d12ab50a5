"""Chapter 06 benchmark: the course's GPTQ and AWQ against a real library, vLLM's
llm-compressor, on the same model, the same calibration tokens and the same evaluator.

    python -m benchmarks.llm_compressor --python /path/to/venv/bin/python [--model bundled]
                                        [--group G] [--windows N] [--json out.json]

llm-compressor 0.14 wants transformers <= 5.17 (the course pins 5.19), so it lives in a
venv of its own: `python -m venv V && V/bin/pip install torch==2.13.0 llmcompressor`
installs against the course's torch without another torch build (checked with the CPU
wheel). This script writes the calibration token ids to a file, runs itself under that
venv's `--python` as a worker (GPTQModifier and AWQModifier, int4 asymmetric, group G,
lm_head kept), which saves each result as a plain HF directory of *dequantized* fp32
weights; then it scores those, our RTN / GPTQ / AWQ and fp32 with the same evaluator.
Without `--python` (or with one where llm-compressor does not import) it says so and
scores ours only. The measuring code is `minillm.bench.llm_compressor`. One SUMMARY line.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import report
from minillm.bench import llm_compressor as bench


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":  # `run_library`'s call
        bench.worker(*sys.argv[2:5], int(sys.argv[5]), sys.argv[6])
        return {}
    ap = report.parser(__doc__, quick="8 held-out windows")
    ap.add_argument("--python", default=None, help="a python with llmcompressor installed")
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument(
        "--library-only", action="store_true", help="skip our GPTQ/AWQ (quant_methods has them)"
    )
    args = ap.parse_args(argv)
    run = report.start(f"llm_compressor {args.model}", args)
    windows = 8 if args.quick else args.windows
    result = bench.compare(args.model, args.python, args.group, windows, args.library_only)
    print(f"model {args.model}, group {result['group']}, {windows} held-out windows of 256 tokens")
    bench.print_rows(result)
    rows = result["rows"]
    parts = [f"{k} {100 * v['ppl_delta']:+.2f}%" for k, v in rows.items() if k != "fp32"]
    run.finish(result, "ppl delta " + ", ".join(parts))
    return rows


if __name__ == "__main__":
    main()
