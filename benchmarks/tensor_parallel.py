"""Tensor parallelism on this CPU: batch-1 decode on two ranks against one, in one run.

    python -m benchmarks.tensor_parallel [--rounds 5] [--quick] [--json out.json]

A TinyLlama-1.1B-shaped model (random weights, 4.4 GB in fp32) on one rank and split over two
(`LLM(tensor_parallel_size=2)`'s ranks, one thread each), timed in turn in every round, with
the collectives' share of a step and the read bandwidth of one core and of two measured in the
same rounds (`minillm.bench.tensor_parallel`). The last line is one `SUMMARY
tensor_parallel:` line.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from minillm.bench import tensor_parallel as tp
from minillm.lab.claims import span


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = report.ranks_args(__doc__, "4 layers, 3 rounds (under a minute)", argv)
    run = report.start("tensor_parallel", args)
    with tempfile.TemporaryDirectory() as tmp:
        result = tp.run(
            Path(tmp), layers=4 if args.quick else None, rounds=3 if args.quick else args.rounds
        )
    tp.print_result(result)
    share = [c["share"] for c in result["collectives"]]
    summary = (
        f"TP=2 {span(result['speedup'])} TP=1 decode tok/s at batch 1; collectives "
        f"{span(share, lambda v: f'{v:.1%}')} of a TP=2 step; 2-core/1-core read bandwidth "
        f"{span(result['bandwidth_ratio'])}"
    )
    return run.finish(result, summary)


if __name__ == "__main__":
    main()
