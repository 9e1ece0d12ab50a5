"""Chapter 10 benchmark: when does speculative decoding pay, on this machine?

    python -m benchmarks.speculative [--quick] [--threads N] [--json results.json]

Target: the bundled model. Draft: the bundled draft (same tokenizer, 2 layers of width
64, trained by the same script: see minillm/bundled_draft/README.md). Three parts; the
last line is one `SUMMARY speculative:` line.

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
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from minillm import (
    BUNDLED_DRAFT_DIR,
    SamplingParams,
    generate,
    load_model,
    load_tokenizer,
)
from minillm.generation import speculative_generate
from minillm.generation.cached import eager_decode_step, prefill
from minillm.generation.speculative import SpecStats, predicted_speedup
from minillm.lab import time_ratios
from minillm.model import (
    Transformer,
    random_model,
)

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the", "Jesus wept"]
KS = (1, 2, 3, 4, 6, 8)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=96, ignore_eos=True, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)


def acceptance(target, draft, prompts, params, ks=KS) -> dict[int, dict[str, float]]:
    """Per k: acceptance rate a, share of proposals kept, tokens per target forward,
    pooled over the prompts."""
    out = {}
    for k in ks:
        total = SpecStats()
        for prompt in prompts:
            tokens, stats = speculative_generate(target, draft, prompt, params, k=k)
            if params.greedy:
                assert tokens == generate(target, [prompt], params)[0], "greedy output changed"
            for field in ("rounds", "proposed", "accepted", "rejected"):
                setattr(total, field, getattr(total, field) + getattr(stats, field))
        out[k] = {
            "acceptance": total.acceptance_rate,
            "kept_fraction": total.kept_fraction,
            "tokens_per_round": total.tokens_per_round,
        }
    return out


def step_cost_ratio(draft: Transformer, target: Transformer, context: int = 32, repeats: int = 10):
    """c: one cached decode step of the draft over one of the target, interleaved."""

    def stepper(model: Transformer):
        cache, _, lengths = prefill(model, [list(range(1, context + 1))], max_tokens=2)
        token, pos = torch.ones(1, 1, dtype=torch.long), lengths[:, None]

        def step():
            cache.kv_len = context  # the same step every call
            eager_decode_step(model, cache, token, pos)

        return step

    with torch.inference_mode():
        ratios = time_ratios(
            {"target": stepper(target), "draft": stepper(draft)}, "target", repeats=repeats
        )
    return ratios["draft"]


def speed(target, draft, prompts, params, ks, repeats: int) -> dict[int, float]:
    """Speed-up of speculative_generate at each k over plain generate (same tokens)."""
    fns: dict[str, Any] = {
        "plain": lambda: [generate(target, [p], params) for p in prompts],
    }
    for k in ks:
        fns[f"k={k}"] = lambda k=k: [
            speculative_generate(target, draft, p, params, k=k) for p in prompts
        ]
    with torch.inference_mode():
        ratios = time_ratios(fns, "plain", repeats=repeats, warmup=1, progress=True)
    return {k: 1 / ratios[f"k={k}"] for k in ks}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer k and repeats, no part (c)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, draft = load_model(), load_model(BUNDLED_DRAFT_DIR)
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    ks = (1, 2, 4) if args.quick else KS
    repeats = 3 if args.quick else 7
    print(f"target {target.num_parameters():,} parameters, draft {draft.num_parameters():,}")

    result: dict[str, Any] = {"threads": args.threads, "ks": list(ks)}
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
    line = (
        f"SUMMARY speculative: greedy acceptance {a_med:.2f} (median over k), draft cost "
        f"c={c:.2f}; best measured speed-up {measured[best]:.2f}x at k={best} "
        f"(predicted {predicted[best]:.2f}x)"
    )
    if "big_draft_cost" in result:
        top = max(result["big_predicted_speedup"].values())
        line += f"; 135M draft / 360M target c={result['big_draft_cost']:.3f} predicts {top:.2f}x"
    line += f"; a draft costing c=0.05 would give {what_if[0.05][1]:.2f}x (k={what_if[0.05][0]})"
    print("\n" + line)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
