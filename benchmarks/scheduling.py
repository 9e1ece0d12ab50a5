"""Why chunked prefill is the default, and when swap beats recompute (chapter 08).

    python -m benchmarks.scheduling [--quick] [--threads 1] [--json out.json]

(a) Chunked prefill (a step budget of `--budget` tokens). Eight requests decode (short
    prompts, long answers) while long prompts (1024 tokens) arrive every so often. Without
    chunking a step either prefills whole prompts or decodes, so every arrival freezes all
    decodes for one long prefill step: an inter-token latency (ITL) spike. With chunking the
    step's token budget serves the decodes first and the rest of it to a chunk of the
    prompt, in the same forward. Same requests, same engine, both policies, interleaved
    `--repeats` times; ITL p50/p99 of the decoding requests and output tokens/s of the whole
    run (medians over repeats).
(b) Preemption. A pool too small for the requests it admits: sequences are preempted and
    either recomputed (their tokens prefilled again) or swapped (their blocks copied to a
    CPU pool and back). Same workload, both modes, at two context lengths: throughput and
    the prompt tokens each mode computed. On this CPU a swap is a memory copy; on a GPU it
    crosses PCIe, and the cost model printed at the end says where the crossover lies.

Model: the bundled model's shapes with random weights and 4096 positions (speed depends on
shapes, not on what the weights learned; the bundled model's own context is 256 tokens).
"""

from __future__ import annotations

from typing import Any

from benchmarks import report
from minillm.bench.scheduling import chunked_prefill, model_with_context, preemption
from minillm.model import load_tokenizer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer requests (about a minute)")
    ap.add_argument("--repeats", type=int, default=3)
    # A prompt token costs this small CPU model about what a decode row does, so the budget
    # that keeps a mixed step near a decode step's time is small; on a GPU (prefill tokens
    # run in parallel almost for free) vLLM's default is 2048 or more.
    ap.add_argument("--budget", type=int, default=64, help="tokens per step when chunked")
    args = ap.parse_args(argv)
    run = report.start("scheduling", args)
    tok, model = load_tokenizer(), model_with_context()
    chunk = chunked_prefill(model, tok, args.quick, args.repeats, args.budget)
    for name in ("chunked", "unchunked"):
        r = chunk[name]
        print(f"{name:10s} ITL p50 {r['itl_p50_ms']:6.1f} ms  p99 {r['itl_p99_ms']:7.1f} ms  "
              f"{r['tok_s']:6.1f} output tok/s")  # fmt: skip
    pre = [preemption(model, tok, c, args.quick) for c in (64, 1024)]
    for r in pre:
        rc, sw = r["recompute"], r["swap"]
        print(f"context {r['context']:5d}: recompute {rc['tok_s']:6.1f} tok/s "
              f"({rc['prompt_tokens_computed']} prompt tokens, {rc['preemptions']} preemptions), "
              f"swap {sw['tok_s']:6.1f} tok/s ({sw['prompt_tokens_computed']}, "
              f"{sw['preemptions']})")  # fmt: skip
    c, u = chunk["chunked"], chunk["unchunked"]
    summary = (
        f"chunked prefill ITL p99/p50 {c['itl_p99_ms'] / c['itl_p50_ms']:.1f}x "
        f"(goal <= 3x) vs {u['itl_p99_ms'] / u['itl_p50_ms']:.1f}x unchunked; throughput "
        f"{c['tok_s'] / u['tok_s']:.2f}x unchunked (goal >= 0.90); swap/recompute throughput "
        f"{pre[0]['swap']['tok_s'] / pre[0]['recompute']['tok_s']:.2f}x at 64-token context, "
        f"{pre[1]['swap']['tok_s'] / pre[1]['recompute']['tok_s']:.2f}x at 1024"
    )
    return run.finish({"chunked_prefill": chunk, "preemption": pre}, summary)


if __name__ == "__main__":
    main()
