"""What every benchmark does around its measurements, written once: the same options
(`--quick`, `--threads`, `--json`), the same header line, the results as one JSON file and
one `SUMMARY <name>:` line at the end, which the README's results table quotes.

    ap = report.parser(__doc__, quick="fewer requests (about a minute)")
    ap.add_argument(...)  # the benchmark's own options
    args = ap.parse_args(argv)
    run = report.start("scheduling", args)
    ...
    return run.finish(results, "chunked ITL p99/p50 ...")

Threads default to 1: on a shared machine a second intra-op thread mostly adds waiting,
and the figures are ratios measured in the same run, which one thread keeps comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minillm.lab import machine_info

SEED = 0


def parser(doc: str | None, quick: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's argument parser: its docstring's first paragraph as the description,
    `--threads`, `--json`, and `--quick` when the benchmark has a quick mode (`quick`: what
    it does)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return ap


def ranks_args(doc: str | None, quick: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of a benchmark whose ranks run one thread each (the parallel ones):
    `parser`'s, `--rounds` (both sizes in each round), `--threads` only 1."""
    ap = parser(doc, quick=quick)
    ap.add_argument("--rounds", type=int, default=5, help="rounds, both sizes in each (5)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    if args.threads != 1:
        ap.error("--threads: the ranks run one thread each; this benchmark takes 1")
    return args


@dataclass
class Run:
    """One benchmark run: started by `start`, closed by `finish`."""

    name: str
    args: argparse.Namespace
    t0: float = field(default_factory=time.perf_counter)
    load_at_start: float = field(default_factory=lambda: os.getloadavg()[0])

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self, results: dict[str, Any], summary: str) -> dict[str, Any]:
        """Add the run's options, duration, date and how busy the shared machine was (the
        1-minute load average at the start and the end, and the higher of the two), write
        the JSON if asked, print the summary."""
        load_at_end = os.getloadavg()[0]
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": max(self.load_at_start, load_at_end),
            "load_average_start_end": [self.load_at_start, load_at_end],
        }
        results = {
            **results,
            "meta": {**meta, **results.get("meta", {})},
            "machine": machine_info(self.args.threads),
            "threads": self.args.threads,
            "quick": getattr(self.args, "quick", False),
            "seconds": self.seconds,
        }
        if self.args.json:
            self.args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"SUMMARY {self.name}: {summary}; {results['seconds']:.0f} s")
        return results


def start(name: str, args: argparse.Namespace, seed: int = SEED) -> Run:
    """Set the thread count and the seed, print the header line, start the clock."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(seed)
    quick = f", quick={args.quick}" if hasattr(args, "quick") else ""
    print(f"torch {torch.__version__}, {args.threads} thread(s){quick}")
    return Run(name, args)
