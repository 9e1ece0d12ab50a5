"""Prompt lookup: speculative decoding without a draft model (vLLM's `ngram` method).

When the output repeats text the context already holds (summarise this, fix the typos in
this, answer with a quote, edit this code) the next tokens are often the ones that followed
the last few tokens the previous time they appeared. So instead of running a draft model,
look the last n tokens up in the prompt and output so far, and propose the k tokens that
followed the match; the target checks them in one forward, exactly as it checks a draft's
(`minillm.generation.speculative.speculate`). No second model, no second tokenizer, and a
proposal costs microseconds; where nothing matches the round is a plain decode step.

The match rule is vLLM's (`prompt_lookup_min`, `prompt_lookup_max`): the longest n in
[ngram_min, ngram_max] whose last-n-tokens occur earlier, and of those occurrences the
earliest (transformers' `prompt_lookup_num_tokens` also takes the first match).

Greedy output equals plain greedy decoding token for token (`verify` keeps a proposal only
where it is the target's argmax). Sampling stays exact too: a looked-up token is a draw from
a draft distribution q that puts all its mass on it, so the rule of Leviathan et al. keeps
it with probability p(x) and otherwise samples from p with x removed, renormalised.
"""

from __future__ import annotations

import torch

from minillm.generation.sampling import SamplingParams
from minillm.generation.speculative import Pick, Proposal, SpecStats, speculate
from minillm.model.transformer import Transformer


def ngram_proposal(tokens: list[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix of
    `tokens` of length n in [ngram_min, ngram_max]; [] when no suffix occurs earlier."""
    total = len(tokens)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        suffix = tokens[total - n :]
        for start in range(total - n):  # earlier occurrences only: start + n < total
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class NgramProposer:
    """Proposes by `ngram_proposal`; as a draft distribution, a one-hot row per proposal
    (on `device`, the target's: the sampling rule subtracts it from the target's p)."""

    def __init__(
        self,
        vocab_size: int,
        ngram_max: int = 3,
        ngram_min: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.vocab_size, self.ngram_max, self.ngram_min = vocab_size, ngram_max, ngram_min
        self.device = torch.device(device)
        self.lookups = 0  # rounds that asked
        self.hits = 0  # rounds that found a match

    def propose(self, tokens: list[int], k: int, pick: Pick, stats: SpecStats) -> Proposal:
        proposal = ngram_proposal(tokens, k, self.ngram_max, self.ngram_min)
        self.lookups += 1
        self.hits += bool(proposal)
        # Greedy verification ignores q; a few one-hot rows cost microseconds to build.
        q = torch.zeros(len(proposal), self.vocab_size, device=self.device)
        q[torch.arange(len(proposal)), proposal] = 1.0
        return proposal, list(q)

    def keep(self, n: int) -> None:
        """Nothing cached: the lookup reads the committed tokens each round."""


def prompt_lookup_generate(
    target: Transformer,
    prompt: list[int],
    params: SamplingParams,
    k: int = 4,
    ngram_max: int = 3,
    ngram_min: int = 1,
) -> tuple[list[int], SpecStats]:
    """Generate like `generate(target, [prompt], params)[0]`, proposing up to k tokens per
    round by prompt lookup. Returns the new tokens and what the rounds did."""
    device = target.lm_head.weight.device
    proposer = NgramProposer(target.config.vocab_size, ngram_max, ngram_min, device)
    return speculate(target, proposer, prompt, params, k)
