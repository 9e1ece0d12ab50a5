"""Decode attention from 128 to 8k tokens: each kv head's K/V read once (grouped SDPA, and the
cache's C step where it runs) or once per query head, against the read bandwidth measured
in the same rounds.

    python -m benchmarks.long_context [--model smollm2] [--quick] [--threads N] [--json out.json]

On SmolLM2-135M (9 query heads on 3 kv heads, 8192 positions), batch 1, the model's dtype
(fp32 on a CPU). Each context's attention (every layer, alone) and whole decode step are
timed in each form in turn, with a 512 MiB read in each round (`minillm.bench.long_context`).
The last line is one `SUMMARY long-context:` line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks import report
from minillm.bench import long_context as bench
from minillm.model import load_model


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="128 to 2048 tokens, 4 rounds (under a minute)")
    ap.add_argument("--model", default="smollm2", help="smollm2 (default) or a checkpoint")
    args = ap.parse_args(argv)
    run = report.start("long-context", args)
    model = load_model(args.model)
    longest = model.config.max_position_embeddings
    lengths = [n for n in (128, 256, 512, 1024, 2048, 4096, 8192) if n <= longest]
    if args.quick:
        lengths = [n for n in lengths if n <= 2048]
    sweep = bench.attention_sweep(model, lengths, repeats=4 if args.quick else 10, progress=True)
    bench.print_sweep(sweep)
    rows = sweep["rows"]
    last = rows[-1]
    forms = list(sweep["forms"])
    growth = {
        name: max(r[name]["growth_over_bytes"] for r in rows[1:] if r["context"] >= 1024)
        for name in forms
    }
    at = [n for n in (2048, last["context"]) if n in {r["context"] for r in rows}]

    def step_growth(name: str) -> str:
        step = {r["context"]: r[name]["step_s"]["median"] for r in rows}
        return ", ".join(f"{n} tokens {step[n] / step[rows[0]['context']]:.2f}x" for n in at)

    summary = (
        "decode step at "
        + "; ".join(f"({name}) {step_growth(name)}" for name in forms if name != "per query head")
        + f" the step at {rows[0]['context']}; "
        f"attention at {last['context']} tokens: grouped "
        f"{last['grouped']['fraction_of_read_bandwidth']['median']:.0%} of the read bandwidth, "
        f"per query head {last['per query head']['fraction_of_read_bandwidth']['median']:.0%}; "
        f"step {last['step_ratio']['min']:.2f}-{last['step_ratio']['max']:.2f}x faster grouped; "
        "largest growth per doubling from 1024 tokens over the bytes' 2x: "
        + ", ".join(f"{growth[name]:.2f} ({name})" for name in forms)
    )
    return run.finish({"model": args.model, "sweep": sweep}, summary)


if __name__ == "__main__":
    main()
