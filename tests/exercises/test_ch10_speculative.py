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

from exercises.feedback import worst
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
    case = "greedy_verify(target rows whose argmax is [3, 1, 4, 1], proposal"
    got = ch10.greedy_verify(logits, [3, 1, 5])
    assert got == (2, 4), (
        f"{case} [3, 1, 5]): expected (2, 4), got {got!r}; hint: keep 3, 1; correct 5 to the "
        "target's 4 (row 2)"
    )
    got = ch10.greedy_verify(logits, [3, 1, 4])
    assert got == (3, 1), (
        f"{case} [3, 1, 4]): expected (3, 1), got {got!r}; hint: all kept: the bonus token is "
        "the target's argmax at row k"
    )
    got = ch10.greedy_verify(logits, [0, 1, 4])
    assert got == (0, 3), (
        f"{case} [0, 1, 4]): expected (0, 3), got {got!r}; hint: the first is wrong: keep none "
        "and emit the target's argmax at row 0, even if later proposals match"
    )
    got = ch10.greedy_verify(logits[:1], [])
    assert got == (0, 3), (
        f"greedy_verify(one target row with argmax 3, proposal []): expected (0, 3), got "
        f"{got!r}; hint: k = 0 is a plain decode step: the target's argmax at row 0"
    )


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
        assert tuple(got) == want, (
            f"greedy_verify(k={k}, proposal {proposal}, target argmax {best}): expected {want} "
            f"(minillm's verify), got {got!r}; hint: keep proposals while each equals the "
            "target's argmax at its row, then emit the argmax at the first miss (or row k)"
        )


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
        case = f"rollback_kv(3 layers of K/V [2, 3, 10, 4], length={length})"
        assert len(cut) == len(cache), (
            f"{case}: expected 3 layers, got {len(cut)}; hint: return one (K, V) per layer"
        )
        for i, ((k, v), (k0, v0)) in enumerate(zip(cut, cache, strict=True)):
            assert k.shape == v.shape == (2, 3, held, 4), (
                f"{case}: expected layer {i}'s K and V of shape (2, 3, {held}, 4), got K "
                f"{tuple(k.shape)}, V {tuple(v.shape)}; hint: the token axis is 2; a length "
                "past the end keeps them all"
            )
            for name, kept, full in (("K", k, k0), ("V", v, v0)):
                assert torch.equal(kept, full[:, :, :held]), (
                    f"{case}: expected layer {i}'s {name} to hold the first {held} tokens: "
                    f"{worst(kept, full[:, :, :held])}; hint: keep the first tokens "
                    "(positions 0 .. length - 1 of axis 2), not the last ones"
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
        assert 0 <= kept <= k, (
            f"greedy_verify(target rows [{k + 1}, vocab], {k} proposals): expected 0 <= kept "
            f"<= {k}, got {kept}; hint: count the proposals kept, at most len(proposal)"
        )
        tokens += [*proposal[:kept], nxt]
        out += [*proposal[:kept], nxt]
        committed = len(tokens) - 1  # each cache holds every token but the last
        for name, cache in caches.items():
            (before,) = cache.lengths
            cache.layers = ch10.rollback_kv(cache.layers, committed)
            assert cache.lengths == {min(before, committed)}, (
                f"rollback_kv({name} cache of {before} tokens, {committed}): expected every "
                f"layer to hold {min(before, committed)} tokens, got {sorted(cache.lengths)}; "
                "hint: cut K and V of every layer along axis 2 to the first `length` tokens"
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
            f"greedy_verify and rollback_kv in a speculative loop, k={k}, prompt {prompt}: "
            f"expected plain greedy decoding's tokens, got token {first} = {got[first]} "
            f"instead of {want[first]}; hint: greedy_verify's correction or bonus token comes "
            "from the target row after the last kept proposal; rollback_kv keeps the first "
            "`length` tokens"
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
        assert 0 <= kept <= 2, (
            f"accept_or_resample(p [3, 5], q [2, 5], proposal {proposal}): expected 0 <= kept "
            f"<= 2, got {kept}; hint: count the proposals kept, at most len(proposal)"
        )
        emitted = proposal[:kept] + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the target here ignores the prefix: position 2 follows p[1]
            second[emitted[1]] += 1
        kept_counts[kept] += 1
    case = "accept_or_resample over 4000 rounds of 2 proposals drawn from q"
    assert all(kept_counts), (
        f"{case}: expected rounds keeping 0, 1 and 2 proposals, got {kept_counts} rounds "
        "each; hint: keep proposal i with probability min(1, p[i, x] / q[i, x]), a fresh "
        "uniform draw for each"
    )
    hint = (
        "accept x with probability min(1, p / q); on the first rejection resample from "
        "max(0, p - q) normalised; all kept: one more token from p[k]"
    )
    ok, why = chi_square_ok(first, p[0])
    assert ok, f"{case}: expected the first token distributed as p[0], got {why}; hint: {hint}"
    ok, why = chi_square_ok(second, p[1])
    assert ok, f"{case}: expected the second token distributed as p[1], got {why}; hint: {hint}"


def test_ch10_accept_or_resample_where_the_answer_is_certain(ch10):
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 7, generator=g), dim=-1)
    for _ in range(50):  # a draft equal to the target is always right
        proposal = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
        kept = ch10.accept_or_resample(p, p[:3].clone(), proposal, g)[0]
        assert kept == 3, (
            f"accept_or_resample(q equal to p, proposal {proposal}): expected all 3 kept, got "
            f"{kept}; hint: with q == p, min(1, p / q) = 1: accept when u * q < p, u in [0, 1)"
        )
    forbidden = p.clone()
    forbidden[0, 2] = 0  # the target never says token 2 first
    forbidden[0] /= forbidden[0].sum()
    draft = torch.zeros(3, 7)
    draft[:, 2] = 1  # the draft always says 2
    for _ in range(50):
        kept, nxt = ch10.accept_or_resample(forbidden, draft, [2, 2, 2], g)
        case = "accept_or_resample(p[0, 2] = 0, a draft that always proposes 2, [2, 2, 2])"
        assert kept == 0, (
            f"{case}: expected the first proposal rejected (kept 0), got kept {kept}; hint: a "
            "token the target gives probability 0 was emitted: accept with min(1, p / q) = 0"
        )
        assert nxt != 2, (
            f"{case}: expected a resampled token other than 2, got {nxt}; hint: resample from "
            "max(0, p - q), which is 0 at token 2"
        )


def test_ch10_expected_tokens_per_round(ch10):
    for (a, k), want, hint in [
        ((0.0, 4), 1.0, "the replacement or bonus token always comes: 1 + a + ... + a^k"),
        ((1.0, 4), 5.0, "a = 1 keeps all k proposals, plus the bonus: mind 1 / (1 - a)"),
        ((0.5, 2), 1.75, "1 + a + a^2: proposal i is kept only if every one before it was"),
        ((0.9, 0), 1.0, "k = 0 is a plain decode step: one token"),
    ]:
        got = ch10.expected_tokens_per_round(a, k)
        assert got == pytest.approx(want), (
            f"expected_tokens_per_round({a}, {k}): expected {want}, got {got!r}; hint: {hint}"
        )
    g = torch.Generator().manual_seed(0)  # a simulation of rounds agrees with the formula
    kept = torch.rand(20000, 3, generator=g) < 0.7
    simulated = 1 + kept.int().cumprod(dim=1).sum(dim=1).float().mean().item()
    got = ch10.expected_tokens_per_round(0.7, 3)
    assert got == pytest.approx(simulated, abs=0.03), (
        f"expected_tokens_per_round(0.7, 3): expected about {simulated:.3f} (20,000 simulated "
        f"rounds), got {got!r}; hint: 1 + a + a^2 + a^3"
    )
    for bad in ((-0.1, 2), (1.5, 2), (0.5, -1)):
        with pytest.raises(ValueError):
            ch10.expected_tokens_per_round(*bad)


def test_ch10_expected_tokens_per_round_matches_a_perfect_draft_in_minillm(ch10):
    model = load_model()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for k in (1, 2, 5):
        _, stats = speculative_generate(model, model, [5, 6, 7], params, k=k)
        # every round but maybe the last emits k + 1 tokens
        got = ch10.expected_tokens_per_round(1.0, k)
        assert stats.tokens_per_round == pytest.approx(got, rel=(k + 1) / 24), (
            f"expected_tokens_per_round(1.0, {k}): expected about {stats.tokens_per_round:.3f} "
            f"(minillm's speculative decoding with a perfect draft), got {got!r}; hint: a "
            "perfect draft keeps all k proposals and adds the bonus token"
        )


def test_ch10_speculative_speedup(ch10):
    cost = "tokens per round / the round's cost in target forwards, k * draft_cost + 1"
    for args, want, hint in [
        ((1.0, 4, 0.1), 5 / 1.4, f"{cost}: 5 tokens for 4 drafts and 1 target forward"),
        ((0.0, 4, 0.1), 1 / 1.4, f"{cost}: a pure loss, 1 token for the same cost"),
        ((0.8, 0, 0.5), 1.0, "k = 0 is plain decoding: no draft runs, no gain"),
    ]:
        got = ch10.speculative_speedup(*args)
        assert got == pytest.approx(want), (
            f"speculative_speedup{args}: expected {want:.4f}, got {got!r}; hint: {hint}"
        )
    gains = [ch10.speculative_speedup(0.8, k, 0.1) for k in range(1, 16)]
    best = gains.index(max(gains)) + 1
    assert 2 < best < 15, (
        f"speculative_speedup(0.8, k, 0.1) for k = 1..15: expected the best k strictly between "
        f"2 and 15, got {best} (speedups {[round(x, 3) for x in gains]}); hint: {cost}"
    )
    with pytest.raises(ValueError):
        ch10.speculative_speedup(0.5, 2, 0.0)
