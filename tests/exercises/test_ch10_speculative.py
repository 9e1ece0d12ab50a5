"""Chapter 10 exercises: speculative sampling's acceptance rule, graded by counting.

`ch10` is `solutions.ch10_speculative` by default, `exercises.ch10_speculative` with
MINILLM_IMPL=exercises (see conftest.py). `-k "ch10 and accept"` picks one exercise.

The reference for the rule is a distribution, not a function: whatever the draft
proposes, the emitted tokens must be distributed as the target's p. The tests draw
thousands of rounds and compare the counts with p by Pearson's chi-square test at the
1-in-1,000 level, then check the rule agrees with `minillm.generation.speculative` where the
answer is certain (p == q keeps everything, p = 0 is never emitted).
"""

from __future__ import annotations

import math

import pytest
import torch

from minillm import SamplingParams, load_model
from minillm.generation import speculative_generate


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, str]:
    """Pearson's test at the 0.001 level over the cells the distribution allows."""
    expected = probs * counts.sum()
    allowed = expected > 0
    if counts[~allowed].sum() > 0:
        return (
            False,
            f"drew tokens {(~allowed & (counts > 0)).nonzero().flatten().tolist()} with p = 0",
        )
    df = int(allowed.sum()) - 1
    statistic = float(((counts[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum())
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    frequencies = (counts / counts.sum()).tolist()
    return statistic < critical, (
        f"chi-square {statistic:.1f} > {critical:.1f}: drawn frequencies "
        f"{[round(f, 3) for f in frequencies]} vs target {[round(x, 3) for x in probs.tolist()]}"
    )


def test_ch10_accept_or_resample_emits_the_targets_distribution(ch10):
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2] * 5])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.2, 0.2], [0.6, 0.1, 0.1, 0.1, 0.1]])
    first, second, kept_counts = torch.zeros(5), torch.zeros(5), [0, 0, 0]
    for _ in range(4000):
        proposal = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        kept, nxt = ch10.accept_or_resample(p, q, proposal, g)
        assert 0 <= kept <= 2, f"kept {kept} of 2 proposals"
        emitted = proposal[:kept] + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the target here ignores the prefix: position 2 follows p[1]
            second[emitted[1]] += 1
        kept_counts[kept] += 1
    assert all(kept_counts), f"rounds by proposals kept (0, 1, 2): {kept_counts}"
    ok, why = chi_square_ok(first, p[0])
    assert ok, f"first token: {why}"
    ok, why = chi_square_ok(second, p[1])
    assert ok, f"second token: {why}"


def test_ch10_accept_or_resample_where_the_answer_is_certain(ch10):
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 7, generator=g), dim=-1)
    for _ in range(50):  # a draft equal to the target is always right
        proposal = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
        assert ch10.accept_or_resample(p, p[:3].clone(), proposal, g)[0] == 3
    forbidden = p.clone()
    forbidden[0, 2] = 0  # the target never says token 2 first
    forbidden[0] /= forbidden[0].sum()
    draft = torch.zeros(3, 7)
    draft[:, 2] = 1  # the draft always says 2
    for _ in range(50):
        kept, nxt = ch10.accept_or_resample(forbidden, draft, [2, 2, 2], g)
        assert kept == 0 and nxt != 2, "a token the target gives probability 0 was emitted"


def test_ch10_expected_tokens_per_round(ch10):
    assert ch10.expected_tokens_per_round(0.0, 4) == pytest.approx(1.0)
    assert ch10.expected_tokens_per_round(1.0, 4) == pytest.approx(5.0)
    assert ch10.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert ch10.expected_tokens_per_round(0.9, 0) == pytest.approx(1.0)
    g = torch.Generator().manual_seed(0)  # a simulation of rounds agrees with the formula
    kept = torch.rand(20000, 3, generator=g) < 0.7
    simulated = 1 + kept.int().cumprod(dim=1).sum(dim=1).float().mean().item()
    assert ch10.expected_tokens_per_round(0.7, 3) == pytest.approx(simulated, abs=0.03)
    for bad in ((-0.1, 2), (1.5, 2), (0.5, -1)):
        with pytest.raises(ValueError):
            ch10.expected_tokens_per_round(*bad)


def test_ch10_expected_tokens_per_round_matches_a_perfect_draft_in_minillm(ch10):
    model = load_model()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for k in (1, 2, 5):
        _, stats = speculative_generate(model, model, [5, 6, 7], params, k=k)
        # every round but maybe the last emits k + 1 tokens
        assert stats.tokens_per_round == pytest.approx(
            ch10.expected_tokens_per_round(1.0, k), rel=(k + 1) / 24
        )


def test_ch10_speculative_speedup(ch10):
    assert ch10.speculative_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert ch10.speculative_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # pure loss
    assert ch10.speculative_speedup(0.8, 0, 0.5) == pytest.approx(1.0)  # k = 0: plain decoding
    gains = [ch10.speculative_speedup(0.8, k, 0.1) for k in range(1, 16)]
    best = gains.index(max(gains)) + 1
    assert 2 < best < 15, f"a=0.8, c=0.1: best k should be inside the range, got {best}"
    with pytest.raises(ValueError):
        ch10.speculative_speedup(0.5, 2, 0.0)
