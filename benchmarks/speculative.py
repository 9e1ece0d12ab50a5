"""Chapter 10 benchmark: when does speculative decoding pay, on this machine?

    python -m benchmarks.speculative [--model smollm2|bundled] [--quick] [--threads N]
                                     [--json results.json]

`--model smollm2` (the default): SmolLM2-135M-Instruct with prompt lookup (n-gram
speculation, no draft model: `minillm.generation.lookup`), on three chat tasks: quoting a
paragraph of the prompt (where lookup shines), summarising it, and free writing (where it
does not). Per task and k: acceptance, tokens per target forward, and the speed-up over
plain `generate`, measured A/B interleaved with the same greedy tokens asserted; and what a
target forward over k + 1 tokens costs against one over 1 token (lookup's only cost).
SmolLM2 has no draft that shares its tokenizer here (the bundled draft's vocabulary is the
KJV model's).

`--model bundled`: target the bundled model, draft the bundled draft (same tokenizer, 2
layers of width 64, trained by the same script: see minillm/bundled_draft/README.md), in
the parts below. The last line is one `SUMMARY speculative:` line either way.

(a) Acceptance: for k = 1..8 proposals per round, greedy and sampled (temperature 0.8),
    the fraction of proposals kept and the tokens emitted per target forward, over the
    same prompts. Greedy outputs are asserted equal to the target's own.
(b) Speed: plain `generate` vs `speculative_generate` at each k, A/B interleaved in this
    run, next to the speed-up the cost model predicts from (a)'s acceptance and the
    draft's measured cost c (a draft decode step's time over the target's).
(c) Shapes that matter: c for a SmolLM2-135M-shaped draft under a SmolLM2-360M-shaped
    target (random weights: cost depends on shapes only), and the speed-up the model
    predicts with (a)'s acceptance rates. Skipped with --quick.

Speed figures are ratios of calls timed in alternation in the same run.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import report
from minillm import BUNDLED_DRAFT_DIR, SamplingParams, load_model, load_tokenizer
from minillm.bench.speculative import (
    GREEDY,
    KS,
    LOOKUP_KS,
    PROMPTS,
    SAMPLED,
    acceptance,
    lookup_acceptance,
    lookup_speed,
    lookup_tasks,
    speed,
    step_cost_ratio,
    verify_cost,
)
from minillm.generation.speculative import predicted_speedup
from minillm.model import random_model


def run_lookup(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """--model smollm2 (or another chat model): prompt lookup on three tasks; (results,
    summary)."""
    name = args.model
    model, tok = load_model(name, device=args.device, dtype=args.dtype), load_tokenizer(name)
    ks = (4,) if args.quick else LOOKUP_KS
    repeats = 3 if args.quick else 5
    params = SamplingParams(temperature=0, max_tokens=48 if args.quick else 96)
    tasks = lookup_tasks(tok)
    print(f"target {name}: {model.num_parameters():,} parameters; prompt lookup, n-gram 1..3")
    result: dict[str, Any] = {"model": name, "ks": list(ks)}
    cost = verify_cost(model, ks, repeats=repeats * 2)
    print("\n(a) a target forward over k + 1 tokens / one over 1 token (160 cached tokens):")
    print("  " + ", ".join(f"k={k}: {c:.2f}x" for k, c in cost.items()))
    result["verify_cost"] = cost
    print(f"\n(b) greedy, up to {params.max_tokens} new tokens; same tokens as plain asserted")
    head = f"{'task':<10} {'prompt':>6} {'k':>3} {'accept':>7} {'hits':>5} {'tok/fwd':>8}"
    print(f"{head} {'speed-up':>9}")
    for task, prompt in tasks.items():
        acc = lookup_acceptance(model, prompt, params, ks)
        up = lookup_speed(model, prompt, params, ks, repeats)
        result[task] = {"prompt_tokens": len(prompt), "acceptance": acc, "speedup": up}
        for k in ks:
            a = acc[k]
            print(
                f"{task:<10} {len(prompt):>6} {k:>3} {a['acceptance']:>7.2f} "
                f"{a['hit_rate']:>5.0%} {a['tokens_per_round']:>8.2f} {up[k]:>8.2f}x"
            )
    best = {t: max(ks, key=lambda k, t=t: result[t]["speedup"][k]) for t in tasks}
    summary = (
        "; ".join(
            f"{t} {result[t]['speedup'][best[t]]:.2f}x at k={best[t]} "
            f"(acceptance {result[t]['acceptance'][best[t]]['acceptance']:.2f}, "
            f"{result[t]['acceptance'][best[t]]['tokens_per_round']:.2f} tokens per forward)"
            for t in tasks
        )
        + f"; a {max(ks) + 1}-token verify costs {cost[max(ks)]:.2f}x a decode step; "
        f"{args.threads} thread(s)"
    )
    return result, summary


def run_draft(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """--model bundled: the bundled draft under the bundled target, parts (a) to (d);
    (results, summary)."""
    target, draft = load_model(), load_model(BUNDLED_DRAFT_DIR)
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    ks = (1, 2, 4) if args.quick else KS
    repeats = 3 if args.quick else 7
    print(f"target {target.num_parameters():,} parameters, draft {draft.num_parameters():,}")

    result: dict[str, Any] = {"ks": list(ks)}
    print("\n(a) acceptance (pooled over prompts, 96 new tokens each)")
    print(f"{'k':>3} {'greedy a':>9} {'tok/round':>9} {'sampled a':>10} {'tok/round':>9}")
    greedy = acceptance(target, draft, prompts, GREEDY, ks)
    sampled = acceptance(target, draft, prompts, SAMPLED, ks)
    for k in ks:
        g, s = greedy[k], sampled[k]
        print(
            f"{k:>3} {g['acceptance']:>9.2f} {g['tokens_per_round']:>9.2f} "
            f"{s['acceptance']:>10.2f} {s['tokens_per_round']:>9.2f}"
        )
    result["greedy"], result["sampled"] = greedy, sampled

    c = step_cost_ratio(draft, target, repeats=repeats * 2)
    print(f"\n(b) draft step cost c = {c:.2f} target steps; speed-up vs plain generate (greedy)")
    measured = speed(target, draft, prompts, GREEDY, ks, repeats)
    print(f"{'k':>3} {'measured':>9} {'predicted':>10}")
    predicted = {k: predicted_speedup(greedy[k]["acceptance"], k, c) for k in ks}
    for k in ks:
        print(f"{k:>3} {measured[k]:>8.2f}x {predicted[k]:>9.2f}x")
    result.update(draft_cost=c, measured_speedup=measured, predicted_speedup=predicted)

    if not args.quick:
        print("\n(c) SmolLM2-135M-shaped draft under a SmolLM2-360M-shaped target (random weights)")
        big_c = step_cost_ratio(random_model("SmolLM2-135M"), random_model("SmolLM2-360M"))
        big = {k: predicted_speedup(greedy[k]["acceptance"], k, big_c) for k in ks}
        print(f"c = {big_c:.3f}; predicted speed-up with (a)'s greedy acceptance:")
        print("  " + ", ".join(f"k={k}: {v:.2f}x" for k, v in big.items()))
        result.update(big_draft_cost=big_c, big_predicted_speedup=big)

    # a barely moves with k (it is a property of the draft/target pair): use its median
    a_med = statistics.median(greedy[k]["acceptance"] for k in ks)
    print(f"\n(d) what it takes: best predicted speed-up over k = 1..16 at a = {a_med:.2f}")
    what_if = {}
    for cost in (0.02, 0.05, 0.1, 0.2, c):
        k_best = max(range(1, 17), key=lambda k, cost=cost: predicted_speedup(a_med, k, cost))
        what_if[cost] = (k_best, predicted_speedup(a_med, k_best, cost))
        print(f"  c={cost:.2f}: {what_if[cost][1]:.2f}x at k={k_best}")
    result["what_if"] = {str(cost): v for cost, v in what_if.items()}

    best = max(ks, key=lambda k: measured[k])
    summary = (
        f"greedy acceptance {a_med:.2f} (median over k), draft cost "
        f"c={c:.2f}; best measured speed-up {measured[best]:.2f}x at k={best} "
        f"(predicted {predicted[best]:.2f}x)"
    )
    if "big_draft_cost" in result:
        top = max(result["big_predicted_speedup"].values())
        summary += (
            f"; 135M draft / 360M target c={result['big_draft_cost']:.3f} predicts {top:.2f}x"
        )
    summary += f"; a draft costing c=0.05 would give {what_if[0.05][1]:.2f}x (k={what_if[0.05][0]})"
    return result, summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__, quick="fewer k and repeats, no part (c)")
    ap.add_argument("--model", default="smollm2", help="smollm2 (prompt lookup) or bundled")
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    ap.add_argument("--dtype", default="auto", help="auto (GPU: bf16, T4: fp16; CPU: fp32), ...")
    args = ap.parse_args(argv)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.model == "bundled":
        run = report.start("speculative", args)
        result, summary = run_draft(args)
    else:
        run = report.start(f"speculative (prompt lookup, {args.model})", args)
        result, summary = run_lookup(args)
    print()
    return run.finish(result, summary)


if __name__ == "__main__":
    main()
