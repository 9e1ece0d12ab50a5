"""Sampling parameters with vLLM's names, and the one sampler every generator draws with.

A token is drawn in three moves, in vLLM's order:

1. the logits are **adjusted** for the sequence so far (`processors.py`): `min_tokens` masks
   the stop tokens, `logit_bias` adds to chosen tokens, then the repetition, frequency and
   presence penalties;
2. greedy (`temperature=0`) takes the argmax of the adjusted logits; otherwise they are
   divided by the temperature, cut by top-k and top-p, and one token is drawn from the
   softmax with the sequence's own RNG;
3. the engine reports **log-probabilities** (`logprobs`) of the model's own distribution:
   the log-softmax of the very logits row the token was drawn from, before any adjustment
   (vLLM V1's default, `raw_logprobs`): an evaluation harness scores the model, not the
   sampling settings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.generation.params import OUTPUT_KINDS, SamplingParams
from minillm.generation.processors import History, adjust_logits

__all__ = [  # SamplingParams lives in params.py; importing it from here keeps working
    "OUTPUT_KINDS",
    "History",
    "SamplingParams",
    "make_generator",
    "probabilities",
    "sample",
    "top_k_filter",
    "top_p_filter",
]


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach p.
    drop = probs.cumsum(dim=-1) - probs >= p
    drop = drop.scatter(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    histories: Sequence[History] | None = None,
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, vocab]: adjusted for each row's
    `histories` (one per row; needed only by penalties and min_tokens), then argmax or a
    draw. The one sampler: the engine, `generate` and every loop of the course call it."""
    if params.adjusts_logits:
        logits = adjust_logits(logits, params, histories)
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from (after any adjustment): temperature, then top-k,
    then top-p (fp32). Each row's maximum is subtracted first, so a tiny temperature gives
    the greedy limit instead of inf - inf = NaN; a row with +inf logits (a tiny
    repetition_penalty divides a positive logit by ~0) is uniform over those, its limit."""
    if params.greedy:
        raise ValueError("greedy sampling (temperature=0) has no distribution: use argmax")
    logits = logits.float()
    infinite = torch.isposinf(logits)
    if infinite.any():
        rows = infinite.any(dim=-1, keepdim=True)
        limit = torch.where(infinite, 0.0, float("-inf"))
        logits = torch.where(rows, limit, logits)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    return top_p_filter(top_k_filter(logits, params.top_k), params.top_p).softmax(dim=-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG so a seeded request is reproducible whatever else runs."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
