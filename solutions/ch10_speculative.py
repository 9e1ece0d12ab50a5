"""Chapter 10 reference answers: same API and docstrings' contract as
`exercises/ch10_speculative.py`, in plain torch (read the docstrings there).

The tests decode with these against plain greedy decoding, count draws against the
target's distribution and compare with `minillm.generation.speculative`, so nothing here
imports minillm.
"""

from __future__ import annotations

import torch


def greedy_verify(target_logits: torch.Tensor, proposal: list[int]) -> tuple[int, int]:
    """Keep proposals while each is the target's argmax; then the target's own next token."""
    choice = target_logits.argmax(dim=-1).tolist()  # the target's greedy pick at k + 1 places
    kept = 0
    while kept < len(proposal) and proposal[kept] == choice[kept]:
        kept += 1
    return kept, choice[kept]  # the correction at the first miss, or the bonus token


def rollback_kv(
    cache: list[tuple[torch.Tensor, torch.Tensor]], length: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V cut to the first `length` tokens (axis 2); shorter: unchanged."""
    if length < 0:
        raise ValueError(f"length={length}: keep 0 or more tokens")
    return [(k[:, :, :length], v[:, :, :length]) for k, v in cache]


def accept_or_resample(
    p: torch.Tensor,
    q: torch.Tensor,
    proposal: list[int],
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Keep proposal i with probability min(1, p/q); on the first rejection resample from
    max(0, p - q); all kept: one more token from p[k]."""
    for i, x in enumerate(proposal):
        u = torch.rand((), generator=generator)
        if u * q[i, x] < p[i, x]:
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        if residual.sum() == 0:  # p == q: rejection has probability 0
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    k = len(proposal)
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def expected_tokens_per_round(acceptance: float, k: int) -> float:
    """1 + a + ... + a^k: the replacement or bonus token, plus each kept proposal."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance={acceptance} must be in [0, 1]")
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    if acceptance == 1:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def speculative_speedup(acceptance: float, k: int, draft_cost: float) -> float:
    """Tokens per round over the round's cost in target forwards (k * c + 1)."""
    if draft_cost <= 0:
        raise ValueError(f"draft_cost={draft_cost} must be > 0")
    return expected_tokens_per_round(acceptance, k) / (k * draft_cost + 1)
