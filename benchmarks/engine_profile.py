"""Where minillm's serving time goes at batch C (chapter 08): one decode step split into
compute kernels, framework and Python, the lm_head's share of it, and the share of an offline
run spent in prefill steps; in process, with a server's settings (no prefix cache).

    python -m benchmarks.engine_profile [--quick] [--sizes 1 8 32] [--model NAME] [--json out.json]

The workload is `python -m benchmarks.llama_cpp`'s (`minillm.bench.workload.make_workload`),
and `python -m benchmarks.llama_cpp --server llama-server --profile` prints the same as its
part (c); the measurement is `minillm.bench.engine_profile.profile`.
"""

from __future__ import annotations

from typing import Any

from benchmarks import report
from minillm import load_tokenizer
from minillm.bench.engine_profile import profile
from minillm.bench.workload import make_workload


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="32 requests instead of 128")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32], help="batch sizes C")
    ap.add_argument("--requests", type=int, default=None, help="default 128 (quick: 32)")
    ap.add_argument("--model", default=None, help="checkpoint or name (default: bundled)")
    ap.add_argument("--ctx-per-slot", type=int, default=256, help="KV tokens per sequence")
    args = ap.parse_args(argv)
    run = report.start("engine-profile", args)
    n = args.requests or (32 if args.quick else 128)
    work = make_workload(load_tokenizer(args.model), n)
    result = profile(args.model, work, args.sizes, args.threads, args.ctx_per_slot)
    summary = f"{args.model or 'bundled'} model, {n} requests: " + ", ".join(
        f"C={c} decode step {1e3 * r['wall_s']:.1f} ms ({r['python_s'] / r['wall_s']:.0%} "
        f"Python, lm_head {r['lm_head_share']:.0%}), {r['prefill_share']:.0%} of a run in prefill"
        for c, r in result.items()
    )
    return run.finish({"requests": n, "profile": result}, summary)


if __name__ == "__main__":
    main()
