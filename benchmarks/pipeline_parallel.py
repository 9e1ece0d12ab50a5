"""Pipeline parallelism on this CPU: two stages against one rank, in one run.

    python -m benchmarks.pipeline_parallel [--rounds 5] [--quick] [--json out.json]

A TinyLlama-1.1B-shaped model (random weights, 4.4 GB in fp32) served by the engine on one
rank and in two stages (`LLM(pipeline_parallel_size=2)`'s ranks, one thread each), timed in
turn in every round: output tok/s of 16 and of 64 concurrent requests, the seconds between
a lone request's tokens, rank 0's wait for rank 1, one core's matmul rate by rows and the
read bandwidth of one core and of two (`minillm.bench.pipeline_parallel`). The last line
is one `SUMMARY pipeline_parallel:` line.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from minillm.bench import pipeline_parallel as pp
from minillm.lab.claims import span


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = report.ranks_args(__doc__, "4 layers, 2 rounds (a minute or two)", argv)
    run = report.start("pipeline_parallel", args)
    with tempfile.TemporaryDirectory() as tmp:
        result = pp.run(
            Path(tmp), layers=4 if args.quick else None, rounds=2 if args.quick else args.rounds
        )
    pp.print_result(result)
    speedups = "; ".join(f"{span(v)} at {c}" for c, v in result["speedup"].items())
    summary = (
        f"PP=2 / PP=1 output tok/s {speedups} concurrent requests; batch-1 latency PP=2/PP=1 "
        f"{span(result['batch1_latency_ratio'])}"
    )
    return run.finish(result, summary)


if __name__ == "__main__":
    main()
