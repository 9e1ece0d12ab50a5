"""torch.compile (inductor, default mode) vs eager for the fixed-shape decode step.

    python -m benchmarks.compile [--model smollm2|bundled] [--threads N] [--tokens 32]
                                 [--repeats N] [--batches 1,8] [--warm-cache] [--json out.json]

Models (`--model`): `smollm2` (the default: SmolLM2-135M-Instruct, 30 layers, 513 MiB of
fp32 weights) and `bundled` (the course's 4-layer, d128 model). On the bundled model one
decode step is ~100 small ops, each a few microseconds of arithmetic, so its time is
mostly per-op overhead (Python, dispatch, allocation): the regime where a compiler that
fuses ops and drops the Python layer pays off on a CPU. SmolLM2's step is dominated by
reading its weights: memory traffic that no fusion removes, so compiling gains far less,
and its cold compile takes minutes on one CPU thread (it scales with the layers traced).
The script measures the split (profile_split) so the ratio can be read against it.

Per batch size (1 and 8): compile time (wall time of the first compiled call, cold
inductor cache unless --warm-cache), then the step's speed ratio eager/compiled, timed
A/B interleaved (`minillm.lab.timing.time_ratios`), then end to end: `generate` (chapter 02,
kv_len shrinking) vs `generate_static` eager and compiled, same prompts and max_tokens
(`minillm.bench.compile.bench_batch`). The last line is one `SUMMARY compile:` line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from benchmarks import report
from minillm.bench import compile as bench
from minillm.model import load_model


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), bundled, a checkpoint")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per generation")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per step pair")
    ap.add_argument("--batches", default="1,8", help="batch sizes, e.g. 1,8")
    ap.add_argument("--warm-cache", action="store_true", help="let inductor reuse its disk cache")
    args = ap.parse_args(argv)
    run = report.start(f"compile ({args.model})", args)
    # Inductor keeps compiled kernels on disk; without this a rerun's "compile time"
    # would be a cache lookup.
    torch.compiler.config.force_disable_caches = not args.warm_cache
    model = load_model(None if args.model == "bundled" else args.model).eval()
    small = model.num_parameters() < 10**7
    repeats = args.repeats or (200 if small else 30)  # a SmolLM2 step is ~100x longer
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"{args.model} {model.num_parameters() / 1e6:.1f}M params, prompt {bench.PROMPT_LEN}, "
        f"{args.tokens} tokens"
    )
    r = {b: bench.bench_batch(model, b, args.tokens, repeats) for b in batches}
    result = {"model": args.model, "tokens": args.tokens, "batches": r}
    parts = [
        f"batch {b}: step eager/compiled {r[b]['step']:.2f}x, generate/compiled end to end "
        f"{r[b]['e2e']:.2f}x, compile {r[b]['compile_s']:.0f} s"
        for b in batches
    ]
    b0 = batches[0]
    summary = (
        "; ".join(parts)
        + f"; eager step {r[b0]['kernel']:.0%} compute at batch {b0}; {args.threads} thread(s); "
        f"tokens equal: {all(x['same'] for x in r.values())}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    return run.finish(result, summary)


if __name__ == "__main__":
    main()
