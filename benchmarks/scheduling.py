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

import statistics
import time
from typing import Any

import numpy as np

from benchmarks import report
from minillm.engine import Engine, SamplingParams
from minillm.model import ModelConfig, load_tokenizer, random_model

SEED = 0


def model_with_context(positions: int = 4096):
    return random_model(ModelConfig(max_position_embeddings=positions, eos_token_id=None), SEED)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind="final_only")


def long_prompt_mix(quick: bool) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    decoders = [rng.integers(10, 4000, 16).tolist() for _ in range(8)]
    n_long = 3 if quick else 6
    longs = [rng.integers(10, 4000, 1024).tolist() for _ in range(n_long)]
    return {"decoders": decoders, "decode_tokens": 96 if quick else 192, "longs": longs}


def run_mix(model, tok, work: dict[str, Any], chunked: bool, budget: int) -> dict[str, Any]:
    """Decoders start together; a long prompt joins every `gap` engine steps."""
    engine = Engine(model, tok, max_num_seqs=16, max_num_batched_tokens=budget,
                    chunked_prefill=chunked)  # fmt: skip
    ids = [engine.add_request(p, greedy(work["decode_tokens"])) for p in work["decoders"]]
    gap = work["decode_tokens"] // (len(work["longs"]) + 1)
    pending, step, t0 = list(work["longs"]), 0, time.perf_counter()
    seqs = {r: engine.requests[r].seqs[0] for r in ids}
    while engine.has_unfinished() or pending:
        if pending and step % gap == gap - 1:
            engine.add_request(pending.pop(0), greedy(8))
        engine.step()
        step += 1
    wall = time.perf_counter() - t0
    itl = [1e3 * d for s in seqs.values() for d in np.diff(s.token_times)]
    out_tokens = len(work["decoders"]) * work["decode_tokens"] + 8 * len(work["longs"])
    p50, p99 = (float(np.percentile(itl, q)) for q in (50, 99))
    return {"itl_p50_ms": p50, "itl_p99_ms": p99, "tok_s": out_tokens / wall}


def chunked_prefill(model, tok, quick: bool, repeats: int, budget: int) -> dict[str, Any]:
    work = long_prompt_mix(quick)
    runs: dict[str, list[dict]] = {"chunked": [], "unchunked": []}
    for _ in range(repeats):  # interleaved: a slow spell hits both policies alike
        for name in runs:
            runs[name].append(run_mix(model, tok, work, name == "chunked", budget))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    med["budget"] = budget
    return med


def preemption(model, tok, context: int, quick: bool) -> dict[str, Any]:
    """8 requests of `context` prompt tokens + 64 new ones on a pool that fits about 4."""
    rng = np.random.default_rng(SEED + context)
    prompts = [rng.integers(10, 4000, context).tolist() for _ in range(4 if quick else 8)]
    blocks = len(prompts) // 2 * -(-context // 16) + 2  # half the prompts fit, not their growth
    out = {"context": context}
    for mode in ("recompute", "swap"):
        engine = Engine(model, tok, num_blocks=blocks, max_num_seqs=8, preemption_mode=mode,
                        num_swap_blocks=8 * blocks)  # fmt: skip
        t0 = time.perf_counter()
        for p in prompts:
            engine.add_request(p, greedy(64))
        engine.run_to_completion()
        wall = time.perf_counter() - t0
        out[mode] = {
            "tok_s": len(prompts) * 64 / wall,
            "prompt_tokens_computed": engine.num_prompt_tokens,
            "preemptions": engine.scheduler.num_preemptions,
        }
    return out


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
