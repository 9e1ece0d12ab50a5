"""minillm against llama.cpp on the CPU, format by format, in one run.

    python -m benchmarks.peers [--model smollm2] [--rounds 5] [--quick] [--json out.json]

Batch-1 decode of minillm in fp32 (the decode layout), int8 and int4 (torch's CPU kernels)
and of llama.cpp's `llama-server` on f32, Q8_0 and Q4_1 GGUFs of the same weights, one thread
each, every format in every round (`minillm.bench.peers`); each format's bytes read per token
and its perplexity on held-out Factbook text. Needs llama-server: `python -m
benchmarks.llama_server` builds it. The last line is one `SUMMARY peers:` line.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from minillm.bench import peers


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="3 rounds, 2 perplexity windows (a few minutes)")
    ap.add_argument("--model", default="smollm2", help="a model name with a packaged GGUF")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, every format in each (5)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    run = report.start("peers", args)
    rounds = 3 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        result = peers.run(
            args.model, rounds=rounds, windows=2 if args.quick else 8, work=Path(tmp)
        )
    peers.print_result(result)
    f = result["formats"]
    summary = (
        "; ".join(
            f"minillm {pair} {min(r):.2f}-{max(r):.2f}x (median {statistics.median(r):.2f}x)"
            for pair, r in peers.pair_ratios(result).items()
        )
        + "; perplexity vs fp32: "
        + ", ".join(
            f"{k.split(' ', 1)[1]} ({k.split(' ')[0]}) {v['ppl_delta']:+.1%}"
            for k, v in f.items()
            if not k.endswith(("fp32", "f32"))
        )
    )
    return run.finish(result, summary)


if __name__ == "__main__":
    main()
