"""Chapter 07 benchmark: how much KV memory holds real tokens, contiguous vs paged.

    python -m benchmarks.paged [--quick] [--requests N] [--json results.json]

Two parts, each printed as a table; the last line is one `SUMMARY paged:` line.

(a) Fragmentation. A trace of requests replayed against a fixed KV budget by a simple
    FCFS scheduler (all requests queued at t=0, one token per running request per step):
      contiguous-max     reserve max_len slots per request (what a static cache does)
      contiguous-pow2    reserve the next power of two >= prompt+output (the vLLM paper's
                         "Orca (Pow2)")
      contiguous-oracle  reserve exactly prompt+output (knows the future)
      paged-B            minillm.cache.BlockManager with blocks of B = 8, 16, 32 tokens,
                         one block at a time; preempts the newest request when out of blocks
    Contiguous regions are placed first-fit in one address space, so freed holes that are
    too small for the next request show up as external fragmentation. Reported while the
    queue is non-empty (the system is full): the split of the budget into real tokens /
    reserved for later / never used (internal) / free but unusable (external) / free, and
    the mean number of requests running at once.
    Trace: prompt and output lengths are lognormal with means of about 161 and 338
    tokens (the ShareGPT averages used by the vLLM paper; the sigmas 1.0 and 0.9 are our
    assumption, not a fit to the data set), clipped so prompt+output <= max_len 2048.
    Budget: 15,360 token slots, about what OPT-13B's 12 GB of KV space on an A100-40GB holds
    (0.8 MB per token), the vLLM paper's setting.
(b) Prefix sharing, on the real BlockManager: a shared system prompt in front of every
    request (memory and prefill tokens with and without the prefix cache), and parallel
    sampling n = 2, 4, 6 via fork (memory vs n independent copies).

Both parts count blocks and tokens: exact, no timing, so no noise. Chapter 07's Triton
kernels (paged decode attention, flash prefill) are timed on a GPU by
`python -m benchmarks.kernels`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks import report
from minillm.bench.paged import (
    BUDGET,
    MAX_LEN,
    POLICIES,
    fragmentation,
    make_trace,
    parallel_sampling,
    print_fragmentation,
    print_sharing,
    shared_system_prompt,
)
from minillm.bench.workload import SEED


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="a shorter trace (about 15 s)")
    ap.add_argument("--requests", type=int, help="requests in the trace (default 1000)")
    args = ap.parse_args(argv)
    run = report.start("paged", args)
    n = args.requests or (300 if args.quick else 1000)
    trace = make_trace(n)
    frag = fragmentation(trace)
    print_fragmentation(frag, trace)
    sys_rows = [shared_system_prompt(trace[:64], s) for s in (128, 512, 1024)]
    par_rows = [parallel_sampling(trace[:100], k) for k in (2, 4, 6)]
    print_sharing(sys_rows, par_rows)
    results = {
        "trace": {"requests": n, "seed": SEED, "budget": BUDGET, "max_len": MAX_LEN},
        "fragmentation": frag,
        "system_prompt": sys_rows,
        "parallel_sampling": par_rows,
    }
    by = {r["policy"]: r for r in frag}
    gain = by["paged-16"]["mean_running"] / by["contiguous-max"]["mean_running"]
    contiguous = [by[p]["tokens"] for p in POLICIES]
    summary = (
        f"real tokens fill {min(contiguous):.1%}-{max(contiguous):.1%} of KV memory with "
        f"contiguous allocation (max/pow2/oracle) vs {by['paged-16']['tokens']:.1%} paged "
        f"(block 16; {by['paged-8']['tokens']:.1%} at 8, {by['paged-32']['tokens']:.1%} at 32); "
        f"requests running at once {by['contiguous-max']['mean_running']:.1f} -> "
        f"{by['paged-16']['mean_running']:.1f} ({gain:.1f}x); "
        f"512-token system prompt: {sys_rows[1]['memory_saved']:.0%} memory saved, "
        f"{sys_rows[1]['prefill_skipped']:.0%} prefill skipped; parallel sampling n=4: "
        f"{par_rows[1]['saved']:.0%} memory saved; {n} requests"
    )
    return run.finish(results, summary)


if __name__ == "__main__":
    main()
