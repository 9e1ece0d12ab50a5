"""Chapter 10's speculative decoding, measured: a draft model's acceptance and speed-up
under its target (`acceptance`, `step_cost_ratio`, `speed`), and prompt lookup (n-gram
proposals, no draft) on chat tasks of a real model (`lookup_tasks`, `lookup_acceptance`,
`lookup_speed`, `verify_cost`). `python -m benchmarks.speculative` runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from minillm.generation import (
    SamplingParams,
    generate,
    greedy_params,
    prompt_lookup_generate,
    speculative_generate,
)
from minillm.generation.cached import eager_decode_step, prefill
from minillm.generation.speculative import SpecStats
from minillm.lab import paired_ratios, time_ratios, time_samples
from minillm.model import Tokenizer, Transformer

PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the", "Jesus wept"]
KS = (1, 2, 3, 4, 6, 8)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=96, ignore_eos=True, seed=0)
GREEDY = greedy_params(96)


def acceptance(
    target: Transformer,
    draft: Transformer,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    ks: Sequence[int] = KS,
) -> dict[int, dict[str, float]]:
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


def step_cost_ratio(
    draft: Transformer, target: Transformer, context: int = 32, repeats: int = 10
) -> float:
    """c: one cached decode step of the draft over one of the target, interleaved."""

    def stepper(model: Transformer) -> Callable[[], None]:
        cache, _, lengths = prefill(model, [list(range(1, context + 1))], max_tokens=2)
        token, pos = torch.ones(1, 1, dtype=torch.long), lengths[:, None]

        def step() -> None:
            cache.kv_len = context  # the same step every call
            eager_decode_step(model, cache, token, pos)

        return step

    with torch.inference_mode():
        ratios = time_ratios(
            {"target": stepper(target), "draft": stepper(draft)}, "target", repeats=repeats
        )
    return ratios["draft"]


def speed(
    target: Transformer,
    draft: Transformer,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    ks: Sequence[int],
    repeats: int,
    progress: bool = True,
) -> dict[int, float]:
    """Speed-up of speculative_generate at each k over plain generate (same tokens);
    `progress=False` for a notebook, whose saved output would keep a frozen bar."""
    fns: dict[str, Any] = {
        "plain": lambda: [generate(target, [p], params) for p in prompts],
    }
    for k in ks:
        fns[f"k={k}"] = lambda k=k: [
            speculative_generate(target, draft, p, params, k=k) for p in prompts
        ]
    with torch.inference_mode():
        ratios = time_ratios(fns, "plain", repeats=repeats, warmup=1, progress=progress)
    return {k: 1 / ratios[f"k={k}"] for k in ks}


# ------------------------------------------------------------ prompt lookup, real model

LOOKUP_KS = (2, 4, 8)


def lookup_tasks(tok: Tokenizer) -> dict[str, list[int]]:
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


def lookup_acceptance(
    model: Transformer, prompt: list[int], params: SamplingParams, ks: Sequence[int] = LOOKUP_KS
) -> dict[int, dict[str, float]]:
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


def lookup_speed(
    model: Transformer,
    prompt: list[int],
    params: SamplingParams,
    ks: Sequence[int] = LOOKUP_KS,
    repeats: int = 5,
) -> dict[int, float]:
    """Speed-up of prompt_lookup_generate at each k over plain generate: median of paired
    per-round ratios, every variant interleaved in one run."""
    fns: dict[str, Any] = {"plain": lambda: generate(model, [prompt], params)}
    for k in ks:
        fns[f"k={k}"] = lambda k=k: prompt_lookup_generate(model, prompt, params, k=k)
    with torch.inference_mode():
        samples = time_samples(fns, repeats=repeats, warmup=1)
    ratios = paired_ratios(samples, "plain")
    return {k: 1 / ratios[f"k={k}"] for k in ks}


def verify_cost(
    model: Transformer, ks: Sequence[int] = LOOKUP_KS, context: int = 160, repeats: int = 10
) -> dict[int, float]:
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
