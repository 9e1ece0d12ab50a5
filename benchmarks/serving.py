"""Chapter 08 benchmark: continuous batching vs static batching vs HF `generate`, offline
and online, with vLLM `bench serve`'s metrics.

    python -m benchmarks.serving [--quick] [--requests N] [--no-online] [--json out.json]

Workload (the same requests for every system): `--requests` prompts (default 128) cut
from the bundled model's held-out text, prompt lengths uniform in [8, 64] tokens, output
lengths log-normal with median 32 tokens and sigma 0.8, clipped to [4, 160], EOS
ignored, greedy. Seeded: the same draw every run.

(a) Offline throughput, one process: minillm continuous batching (`Engine`, up to
    `--batch` sequences), the static-batching baseline (same engine, fixed batches of
    `--batch` that wait for their longest request) and transformers `generate` with
    left padding in batches of `--batch` (each batch runs to its longest output). The
    three are timed interleaved, round-robin, and the result is the median paired time
    ratio. Also per-mode slot utilisation (mean running sequences per decode step /
    batch) and the latency metrics of the continuous run (all requests arrive at t=0).
(b) Online: `minillm` served over HTTP in a subprocess; an asyncio client streams each
    request (prompt token ids, `/v1/completions`) with Poisson arrivals at a few rates
    (fractions of the offline request throughput, plus all-at-once) and measures, as
    vLLM's `bench serve` defines them: TTFT (send -> first token), TPOT ((E2E - TTFT) /
    (output tokens - 1)), ITL (gaps between streamed chunks), E2E latency, request and
    output-token throughput; p50 and p99.

The last lines are `SUMMARY serving-offline:` and `SUMMARY serving-online:`.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import report
from minillm import load_model, load_tokenizer
from minillm.bench import batching
from minillm.bench.http_load import ms


def print_offline(off: dict[str, Any], cost: dict[str, Any]) -> None:
    """Part (a): steps, utilisation, the step-cost model and latencies of each mode."""
    print("\n(a) offline")
    print(
        f"  continuous: {off['continuous_tok_s']:.0f} output tok/s, "
        f"{off['steps']['continuous']} steps ({off['prefill_steps']['continuous']} prefill), "
        f"slot utilisation {off['utilisation']['continuous']:.0%}"
    )
    print(
        f"  static:     {off['speedup_vs_static']:.2f}x the time of continuous, "
        f"{off['steps']['static']} steps ({off['prefill_steps']['static']} prefill), "
        f"slot utilisation {off['utilisation']['static']:.0%}"
    )
    print(
        "  decode step cost vs batch 1 (interleaved): "
        + ", ".join(f"{k} {v:.2f}x" for k, v in cost["relative"].items())
    )
    print(
        f"  why: continuous takes {off['model']['flat']:.2f}x fewer steps (its speed-up if a "
        "step cost the same whatever it computes, a GPU's regime); costed on the step-cost "
        f"curve above (a prompt token as a row), those steps predict {off['model']['curve']:.2f}x"
    )
    if "speedup_vs_hf" in off:
        print(
            f"  HF generate (padded batches): {off['speedup_vs_hf']:.2f}x the time of "
            f"continuous; same greedy tokens on {off['hf_same_tokens']:.0%} of requests"
        )
    for mode in ("continuous", "static"):
        lat = off[f"latency_{mode}"]
        print(
            f"  {mode:10s} latency (all sent at t=0) p50/p99 ms: "
            + ", ".join(f"{k.upper()} {ms(v['p50'])}/{ms(v['p99'])}" for k, v in lat.items())
        )


def print_online(rows: list[dict[str, Any]]) -> None:
    """Part (b): one row per arrival rate."""
    print(
        "  rate req/s | done req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 | "
        "ITL p50/p99 | E2E p50/p99"
    )
    for r in rows:
        print(
            f"  {r['rate']:10.1f} | {r['req_s']:10.1f} | {r['output_tok_s']:9.0f} | "
            + " | ".join(
                f"{ms(r[k]['p50'])}/{ms(r[k]['p99'])}" for k in ("ttft", "tpot", "itl", "e2e")
            )
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="48 requests, batch 16, 1 round")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="default 32 (quick: 16)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--model", default=None, help="bundled (default), smollm2, or a dir")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-online", action="store_true")
    args = ap.parse_args(argv)
    run = report.start("serving-offline", args)
    n = args.requests or (48 if args.quick else 128)
    batch = args.batch or (16 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    work = batching.make_workload(tokenizer, n)
    hf = None if args.no_hf else batching.hf_model(model=args.model)
    print(
        f"workload: {n} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
        f"{sum(k for _, k in work)} output tokens; batch {batch}; torch threads "
        f"{args.threads}; {repeats} interleaved round(s)"
    )
    off = batching.offline(model, tokenizer, work, batch, repeats, hf)
    cost = batching.decode_step_cost(model, tokenizer)
    off["model"] = batching.batching_model(off["step_tokens"], cost["relative"])
    print_offline(off, cost)
    summary = f"{n} requests, batch {batch}: continuous {off['continuous_tok_s']:.0f} tok/s = "
    summary += f"{off['speedup_vs_static']:.2f}x static"
    if hf is not None:
        summary += f", {off['speedup_vs_hf']:.2f}x HF generate (padded)"
    summary += (
        f"; decode step at B=32 costs {cost['relative']['B=32']:.1f}x B=1, so "
        f"{off['model']['flat']:.2f}x fewer steps predict {off['model']['curve']:.2f}x"
        f"; slot utilisation {off['utilisation']['static']:.0%} static -> "
        f"{off['utilisation']['continuous']:.0%} continuous"
    )
    results: dict[str, Any] = {"offline": off, "decode_step_cost": cost}
    online_summary = None
    if not args.no_online:
        capacity = off["continuous_req_s"]
        fractions = [0.25, 1.0] if args.quick else [0.25, 0.5, 1.0]
        rates = [f * capacity for f in fractions] + [math.inf]
        print(f"\n(b) online, Poisson arrivals (offline capacity {capacity:.1f} req/s)")
        rows = batching.online(work, rates, batch, args.model)
        results["online"] = rows
        print_online(rows)
        best, low = max(rows, key=lambda r: r["output_tok_s"]), rows[0]
        online_summary = (
            f"SUMMARY serving-online: at {low['rate']:.1f} req/s TTFT p50 {ms(low['ttft']['p50'])}"
            f" ms, TPOT p50 {ms(low['tpot']['p50'])} ms; peak {best['output_tok_s']:.0f} "
            f"out tok/s ({best['req_s']:.1f} req/s) with TTFT p99 {ms(best['ttft']['p99'])} ms"
        )
    print()
    results = run.finish(results, summary)  # SUMMARY serving-offline, then the online one
    if online_summary:
        print(online_summary)
    return results


if __name__ == "__main__":
    main()
