"""The `bench` command line (`python -m minillm bench`, `python -m minillm.bench`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minillm.bench.backends import ALL
from minillm.bench.harness import run_bench
from minillm.bench.report import format_table, label_of
from minillm.bench.workload import WORKLOADS


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m minillm.bench` (the same options as `python -m minillm bench`)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m minillm.bench",
        description="One benchmark harness over every inference stack.",
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: Any) -> None:
    """The bench command's options (shared by `python -m minillm bench`)."""
    parser.add_argument(
        "--backends",
        default="all",
        help=f"comma-separated: {', '.join(ALL)}, openai:URL, openai-text:URL, "
        "openai-chat:URL, all",
    )
    parser.add_argument(
        "--workload", default="small", help=f"{', '.join(WORKLOADS)}, a JSON object or a .json file"
    )
    parser.add_argument(
        "--concurrency", default="1", help="requests in flight, e.g. 1,8 (batching backends)"
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint directory (default: the bundled model)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--threads", type=int, default=1, help="torch / ORT intra-op threads")
    parser.add_argument("--warmup", type=int, default=1, help="requests run before timing")
    parser.add_argument(
        "--rounds", type=int, default=1, help="timed runs per backend, interleaved across them"
    )
    parser.add_argument("--skip", default="", help="comma-separated backends to list, not run")
    parser.add_argument(
        "--isolate", action="store_true", help="each in-process backend in its own process"
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--no-progress", action="store_true")


def run_from_args(args: Any) -> dict[str, Any]:
    """Run, print the table (and a SUMMARY line), write --json."""
    result = run_bench(
        args.backends,
        args.workload,
        concurrency=[int(c) for c in str(args.concurrency).split(",")],
        model_path=args.model,
        device=args.device,
        threads=args.threads,
        warmup=args.warmup,
        progress=not args.no_progress,
        skip=[s.strip() for s in args.skip.split(",") if s.strip()],
        isolate=args.isolate,
        rounds=args.rounds,
    )
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    ok = [r for r in result["results"] if r["status"] == "ok"]
    print(
        f"SUMMARY bench: {len(ok)}/{len(result['results'])} backends ran; "
        + ", ".join(
            f"{label_of(r)} TPOT p50 {r['tpot_ms']['p50']:.1f} ms, {r['output_tok_s']:.0f} tok/s"
            for r in ok
        )
    )
    return result
