"""Chapter 10 exercises: speculative decoding's rules, graded against the target alone.

`ch10` is `solutions.ch10_speculative` by default, `exercises.ch10_speculative` with
MINILLM_IMPL=exercises (see conftest.py). `-k "ch10 and accept"` picks one exercise.

Greedy verification and the KV rollback are graded by decoding: a speculative loop (the
bundled draft proposes, the bundled target verifies, both with a Hugging Face-style cache
grown by concatenation) runs on the learner's `greedy_verify` and `rollback_kv`, must emit
exactly the tokens of plain greedy decoding of the target, and must leave each cache
holding exactly the committed tokens after every rollback.

The reference for the sampling rule is a distribution, not a function: whatever the draft
proposes, the emitted tokens must be distributed as the target's p. The tests draw
thousands of rounds and compare the counts with p by Pearson's chi-square test at the
1-in-1,000 level, then check the rule agrees with `minillm.generation.speculative` where the
answer is certain (p == q keeps everything, p = 0 is never emitted).
"""

from __future__ import annotations

import math

import pytest
import torch

from minillm import BUNDLED_DRAFT_DIR, SamplingParams, generate, load_model
from minillm.cache.protocol import SdpaCache
from minillm.generation import speculative_generate
from minillm.generation.speculative import verify
from minillm.model.transformer import Transformer

GREEDY = SamplingParams(temperature=0)


def test_ch10_greedy_verify_by_hand(ch10):
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([3, 1, 4, 1]):  # the target's greedy picks at the 4 places
        logits[row, best] = 2.0
    assert ch10.greedy_verify(logits, [3, 1, 5]) == (2, 4), "keep 3, 1; correct 5 to 4"
    assert ch10.greedy_verify(logits, [3, 1, 4]) == (3, 1), "all kept: the bonus is row k"
    assert ch10.greedy_verify(logits, [0, 1, 4]) == (0, 3), "the first is wrong: keep none"
    assert ch10.greedy_verify(logits[:1], []) == (0, 3), "k = 0: a plain decode step"


def test_ch10_greedy_verify_agrees_with_minillm(ch10):
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        k = trial % 6
        logits = torch.randn(k + 1, 11, generator=g)
        best = logits.argmax(-1).tolist()
        # proposals right up to a random point, then anything (right again by chance too)
        cut = int(torch.randint(0, k + 1, (), generator=g))
        tail = torch.randint(0, 11, (k,), generator=g).tolist()
        proposal = best[:cut] + tail[cut:k]
        got = ch10.greedy_verify(logits, proposal)
        want = verify(logits, proposal, None, GREEDY)
        assert tuple(got) == want, f"k={k}, proposal {proposal}, argmax {best}: {got} != {want}"


def random_cache(layers=3, tokens=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, 3, tokens, 4, generator=g), torch.randn(2, 3, tokens, 4, generator=g))
        for _ in range(layers)
    ]


def test_ch10_rollback_kv_keeps_the_first_tokens(ch10):
    cache = random_cache()
    for length, held in ((6, 6), (1, 1), (0, 0), (10, 10), (12, 10)):
        cut = ch10.rollback_kv(cache, length)
        assert len(cut) == len(cache), f"rollback to {length}: {len(cut)} layers, not 3"
        for i, ((k, v), (k0, v0)) in enumerate(zip(cut, cache, strict=True)):
            assert k.shape == v.shape == (2, 3, held, 4), (
                f"rollback to {length}: layer {i} K {tuple(k.shape)}, V {tuple(v.shape)}; "
                f"expected (2, 3, {held}, 4): the token axis is 2"
            )
            assert torch.equal(k, k0[:, :, :held]) and torch.equal(v, v0[:, :, :held]), (
                f"rollback to {length}: layer {i} does not hold the first {held} tokens' K/V"
            )
    with pytest.raises(ValueError):
        ch10.rollback_kv(cache, -1)


class ConcatKV(SdpaCache):
    """Hugging Face's cache layout: per layer one (K, V) [1, kv_heads, tokens, head_dim],
    grown by concatenation; `layers` is what `rollback_kv` cuts."""

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        empty = torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
        self.layers = [(empty, empty) for _ in range(cfg.num_hidden_layers)]
        self.start = 0  # tokens held before this forward (every layer's mask uses it)

    @property
    def lengths(self) -> set[int]:
        return {t.shape[2] for kv in self.layers for t in kv}

    def update(self, layer, k, v, positions):
        pk, pv = self.layers[layer]
        self.layers[layer] = (torch.cat([pk, k], 2), torch.cat([pv, v], 2))
        return self.layers[layer]

    def causal_mask(self, positions):
        slots = torch.arange(self.start + positions.shape[1])
        return (slots <= positions[..., None])[:, None]

    def feed(self, model: Transformer, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of tokens placed after the cached ones."""
        (self.start,) = self.lengths
        positions = torch.arange(self.start, self.start + len(tokens))[None]
        return model(torch.tensor([tokens]), positions, cache=self)[0]


@torch.inference_mode()
def speculative_greedy(ch10, target, draft, prompt, n_new, k):
    """The loop of minillm.generation.speculative.speculate, greedy, on the learner's
    greedy_verify and rollback_kv."""
    caches = {"target": ConcatKV(target), "draft": ConcatKV(draft)}
    tokens, out = list(prompt), []
    while len(out) < n_new:
        dc = caches["draft"]
        (held,) = dc.lengths
        logits, proposal = dc.feed(draft, tokens[held:])[-1], []
        for i in range(k):  # the draft proposes k tokens, greedily
            proposal.append(int(logits.argmax()))
            if i < k - 1:
                logits = dc.feed(draft, proposal[-1:])[-1]
        (held,) = caches["target"].lengths  # the target checks them in one forward
        rows = caches["target"].feed(target, tokens[held:] + proposal)[-(k + 1) :]
        kept, nxt = ch10.greedy_verify(rows, proposal)
        assert 0 <= kept <= k, f"greedy_verify kept {kept} of {k} proposals"
        tokens += [*proposal[:kept], nxt]
        out += [*proposal[:kept], nxt]
        committed = len(tokens) - 1  # each cache holds every token but the last
        for name, cache in caches.items():
            (before,) = cache.lengths
            cache.layers = ch10.rollback_kv(cache.layers, committed)
            assert cache.lengths == {min(before, committed)}, (
                f"{name} cache held {before} tokens; after rollback_kv(cache, {committed}) "
                f"its layers hold {sorted(cache.lengths)}, expected {min(before, committed)}"
            )
    return out[:n_new]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ch10_greedy_verify_and_rollback_kv_decode_as_the_target(ch10, k):
    target, draft = load_model(), load_model(BUNDLED_DRAFT_DIR)
    for prompt in ([5, 6, 7], [40, 41, 42, 43, 44, 45]):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        want = generate(target, [prompt], params)[0]
        got = speculative_greedy(ch10, target, draft, prompt, 40, k)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        assert got == want, (
            f"k={k}, prompt {prompt}: token {first} differs from plain greedy decoding "
            f"({got[first]} vs {want[first]})"
        )


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
