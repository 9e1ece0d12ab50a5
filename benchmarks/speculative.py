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
from minillm.generation import prompt_lookup_generate, speculative_generate
from minillm.generation.cached import eager_decode_step, prefill
from minillm.generation.speculative import SpecStats, predicted_speedup
from minillm.lab import paired_ratios, time_ratios, time_samples
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


# ------------------------------------------------------------ prompt lookup, real model

LOOKUP_KS = (2, 4, 8)


def lookup_tasks(tok) -> dict[str, list[int]]:
    """Three chat prompts (the model's template) on one CIA World Factbook paragraph: copy
    it, summarise it, and a free-writing prompt that has nothing to copy."""
    from minillm.training.english import load_factbook

    paragraph = next(p for p in load_factbook() if 500 < len(p) < 800)
    tasks = {
        "quote": f"Copy this paragraph word for word:\n\n{paragraph}",
        "summarise": f"Summarize this paragraph:\n\n{paragraph}",
        "free": "Write a short poem about the sea.",
    }
    return {k: tok.apply_chat_template([{"role": "user", "content": v}]) for k, v in tasks.items()}


def lookup_acceptance(model, prompt, params, ks=LOOKUP_KS) -> dict[int, dict[str, float]]:
    """Per k: acceptance, share of rounds that found a match, tokens per target forward;
    asserts the tokens equal plain greedy decoding."""
    from minillm.generation.lookup import NgramProposer
    from minillm.generation.speculative import speculate

    plain = generate(model, [prompt], params)[0]
    out = {}
    for k in ks:
        proposer = NgramProposer(model.config.vocab_size, device=model.lm_head.weight.device)
        tokens, stats = speculate(model, proposer, prompt, params, k)
        assert tokens == plain, f"prompt lookup changed the greedy output (k={k})"
        out[k] = {
            "acceptance": stats.acceptance_rate,
            "hit_rate": proposer.hits / proposer.lookups,
            "tokens_per_round": stats.tokens_per_round,
            "new_tokens": len(tokens),
        }
    return out


def lookup_speed(model, prompt, params, ks=LOOKUP_KS, repeats: int = 5) -> dict[int, float]:
    """Speed-up of prompt_lookup_generate at each k over plain generate: median of paired
    per-round ratios, every variant interleaved in one run."""
    fns: dict[str, Any] = {"plain": lambda: generate(model, [prompt], params)}
    for k in ks:
        fns[f"k={k}"] = lambda k=k: prompt_lookup_generate(model, prompt, params, k=k)
    with torch.inference_mode():
        samples = time_samples(fns, repeats=repeats, warmup=1)
    ratios = paired_ratios(samples, "plain")
    return {k: 1 / ratios[f"k={k}"] for k in ks}


def verify_cost(model, ks=LOOKUP_KS, context: int = 160, repeats: int = 10) -> dict[int, float]:
    """A target forward over k + 1 new tokens (a verification) over one over 1 token (a
    decode step), both at `context` cached tokens: what a round costs when no proposal is
    kept. At batch 1 both read every weight once; the extra rows are extra arithmetic."""
    device = model.lm_head.weight.device
    ids = torch.arange(1, context + 1, device=device)[None]
    fns = {}
    for n in (1, *(k + 1 for k in ks)):
        cache, _, _ = prefill(model, [ids[0].tolist()], max_tokens=max(ks) + 1)
        new = torch.ones(1, n, dtype=torch.long, device=device)
        pos = torch.arange(context, context + n, device=device)[None]

        def forward(cache=cache, new=new, pos=pos, n=n) -> None:
            cache.kv_len = context + n
            model(new, pos, cache=cache)

        fns[n] = forward
    with torch.inference_mode():
        samples = time_samples(fns, repeats=repeats, warmup=2)
    ratios = paired_ratios(samples, 1)
    return {k: ratios[k + 1] for k in ks}


def main_lookup(args, name: str) -> dict[str, Any]:
    """--model smollm2 (or another chat model): prompt lookup on three tasks."""
    model, tok = load_model(name, device=args.device, dtype=args.dtype), load_tokenizer(name)
    ks = (4,) if args.quick else LOOKUP_KS
    repeats = 3 if args.quick else 5
    params = SamplingParams(temperature=0, max_tokens=48 if args.quick else 96)
    tasks = lookup_tasks(tok)
    print(f"target {name}: {model.num_parameters():,} parameters; prompt lookup, n-gram 1..3")
    result: dict[str, Any] = {"model": name, "threads": args.threads, "ks": list(ks)}
    cost = verify_cost(model, ks, repeats=repeats * 2)
    print("\n(a) a target forward over k + 1 tokens / one over 1 token (160 cached tokens):")
    print("  " + ", ".join(f"k={k}: {c:.2f}x" for k, c in cost.items()))
    result["verify_cost"] = cost
    print(f"\n(b) greedy, up to {params.max_tokens} new tokens; same tokens as plain asserted")
    head = f"{'task':<10} {'prompt':>6} {'k':>3} {'accept':>7} {'hits':>5} {'tok/fwd':>8}"
    print(f"{head} {'speed-up':>9}")
    for task, prompt in tasks.items():
        acc = lookup_acceptance(model, prompt, params, ks)
        speed = lookup_speed(model, prompt, params, ks, repeats)
        result[task] = {"prompt_tokens": len(prompt), "acceptance": acc, "speedup": speed}
        for k in ks:
            a = acc[k]
            print(
                f"{task:<10} {len(prompt):>6} {k:>3} {a['acceptance']:>7.2f} "
                f"{a['hit_rate']:>5.0%} {a['tokens_per_round']:>8.2f} {speed[k]:>8.2f}x"
            )
    best = {t: max(ks, key=lambda k, t=t: result[t]["speedup"][k]) for t in tasks}
    print(
        "\nSUMMARY speculative (prompt lookup, "
        + name
        + "): "
        + "; ".join(
            f"{t} {result[t]['speedup'][best[t]]:.2f}x at k={best[t]} "
            f"(acceptance {result[t]['acceptance'][best[t]]['acceptance']:.2f}, "
            f"{result[t]['acceptance'][best[t]]['tokens_per_round']:.2f} tokens per forward)"
            for t in tasks
        )
        + f"; a {max(ks) + 1}-token verify costs {cost[max(ks)]:.2f}x a decode step; "
        f"{args.threads} thread(s)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (prompt lookup) or bundled")
    ap.add_argument("--quick", action="store_true", help="fewer k and repeats, no part (c)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on a CPU), ...")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model != "bundled":
        return main_lookup(args, args.model)
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
