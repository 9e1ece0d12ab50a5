"""Speculative decoding changes the cost, not the output: greedy tokens equal the target's,
and sampled tokens follow the target's distribution (counted on a tiny vocabulary)."""

import math

import pytest
import torch

from minillm import SamplingParams, generate
from minillm.generation import speculative_generate
from minillm.generation.sampling import probabilities
from minillm.generation.speculative import verify
from minillm.model import ModelConfig, Transformer


def tiny(vocab: int, dim: int, layers: int, seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=None,
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():  # tied unit-variance embeddings give near one-hot logits: soften them
        model.lm_head.weight.mul_(0.05)
    return model


@pytest.fixture(scope="module")
def bad_draft(model):
    """A random draft with the bundled vocabulary: it rarely agrees with the target."""
    cfg = ModelConfig(**{**model.config.__dict__, "num_hidden_layers": 1, "hidden_size": 32})
    cfg.intermediate_size, cfg.head_dim = 64, 8
    torch.manual_seed(0)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_equals_the_target_alone_with_a_perfect_or_a_bad_draft(model, prompts, k, bad_draft):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompt in prompts:
        alone = generate(model, [prompt], params)[0]
        same, perfect = speculative_generate(model, model, prompt, params, k=k)
        assert same == alone
        assert perfect.acceptance_rate == 1.0
        assert perfect.rounds == math.ceil(30 / (k + 1))  # k + 1 tokens per target forward
        mixed, bad = speculative_generate(model, bad_draft, prompt, params, k=k)
        assert mixed == alone
        assert bad.acceptance_rate < 0.5 and bad.rounds > perfect.rounds
        assert bad.accepted + bad.rounds == len(mixed)  # each round: kept proposals + 1
        assert bad.rejected <= bad.rounds and bad.kept_fraction <= bad.acceptance_rate


def test_generation_stops_at_a_stop_token_inside_an_accepted_run(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = generate(model, [prompts[0]], params)[0]
    stop = alone[5]
    params.stop_token_ids = [stop]
    expected = alone[: alone.index(stop) + 1]
    assert generate(model, [prompts[0]], params)[0] == expected
    assert speculative_generate(model, model, prompts[0], params, k=4)[0] == expected


def target_distribution(target: Transformer, prompt: list[int], params, vocab: int):
    """Exact probability of every 2-token continuation under plain sampling from the target."""
    with torch.no_grad():
        first = probabilities(target(torch.tensor([prompt]))[0, -1], params)
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        second = probabilities(target(seqs)[:, -1], params)
    return first[:, None] * second  # [vocab, vocab]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(Pearson's statistic, the value chance exceeds once in 1,000 runs) over non-zero cells."""
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum() > 0:  # sampled a token these probabilities forbid
        return math.inf, 0.0
    df = int(keep.sum()) - 1
    z = 3.09  # the normal's 0.999 quantile; Wilson-Hilferty turns it into chi-square's
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), critical


def test_sampled_tokens_follow_the_target_distribution_not_the_drafts():
    vocab, n = 6, 1500
    target, draft = tiny(vocab, 16, 1, seed=1), tiny(vocab, 16, 1, seed=2)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=2, seed=0)
    exact = target_distribution(target, prompt, params, vocab)
    from_draft = target_distribution(draft, prompt, params, vocab)
    assert 0.5 * (exact - from_draft).abs().sum() > 0.2  # the two models really differ
    counts = torch.zeros(vocab, vocab)
    accepted = 0
    for seed in range(n):
        params.seed = seed
        (a, b), stats = speculative_generate(target, draft, prompt, params, k=2)
        counts[a, b] += 1
        accepted += stats.accepted
    assert 0 < accepted < n  # both branches of the rule ran: some kept, some rejected
    statistic, critical = chi_square(counts, exact)  # top-k=5 leaves 25 of the 36 cells
    assert statistic < critical, "speculative sampling does not follow the target"
    statistic, critical = chi_square(counts, from_draft)
    assert statistic > 10 * critical  # and the test can tell the draft's from the target's


def test_verify_rejects_inconsistent_inputs_and_mismatched_vocabularies(model):
    greedy = SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="k \\+ 1 = 3 rows"):
        verify(torch.zeros(2, 8), [1, 2], None, greedy)
    with pytest.raises(ValueError, match="draft's distribution"):
        verify(torch.zeros(3, 8), [1, 2], None, SamplingParams(temperature=1))
    other = tiny(8, 16, 1, seed=0)
    with pytest.raises(ValueError, match="--tokenizer"):
        speculative_generate(model, other, [1, 2], greedy)
    with pytest.raises(ValueError, match="k=0"):
        speculative_generate(model, model, [1, 2], greedy, k=0)


# ----------------------------------------------------------------- prompt lookup (n-gram)


def test_ngram_proposal_takes_the_longest_suffix_and_its_earliest_occurrence():
    from minillm.generation.lookup import ngram_proposal

    # vLLM's docstring example: [4, 2, 3] never occurred before; [2, 3] did, at 1.
    assert ngram_proposal([1, 2, 3, 4, 2, 3], k=4, ngram_max=3, ngram_min=2) == [4, 2, 3]
    assert ngram_proposal([7, 1, 9, 5, 1, 8, 1], k=2, ngram_max=3) == [9, 5]  # earliest "1"
    assert ngram_proposal([5, 6, 7, 5, 6], k=1, ngram_max=2) == [7]
    assert ngram_proposal([1, 2, 3], k=4) == []  # nothing repeats
    assert ngram_proposal([1, 2, 1], k=4, ngram_min=2) == []  # only a 1-gram repeats
    assert ngram_proposal([3], k=4) == []


def test_prompt_lookup_equals_plain_greedy_and_accepts_a_quoted_prompt(model, prompts):
    from minillm.generation.lookup import prompt_lookup_generate

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in prompts:
        for k in (1, 4):
            tokens, stats = prompt_lookup_generate(model, prompt, params, k=k)
            assert tokens == generate(model, [prompt], params)[0]
            assert stats.accepted + stats.rounds == len(tokens)
    # A prompt that holds the continuation: repeat the model's own greedy text twice, so
    # the third copy is a lookup away; most proposals are kept, far fewer target forwards.
    text = generate(model, [prompts[1]], SamplingParams(temperature=0, max_tokens=30))[0]
    prompt = prompts[1] + text + prompts[1] + text + prompts[1]
    plain = generate(model, [prompt], params)[0]
    tokens, stats = prompt_lookup_generate(model, prompt, params, k=4)
    assert tokens == plain
    assert stats.acceptance_rate > 0.5 and stats.rounds < len(tokens) / 2


def test_prompt_lookup_sampling_follows_the_target_distribution():
    """One-hot proposals through the rejection rule: sampled tokens still follow p."""
    from minillm.generation.lookup import prompt_lookup_generate

    vocab, n = 6, 2000
    target = tiny(vocab, 16, 1, seed=1)
    prompt = [1, 2, 3, 1, 2]  # the lookup proposes 3, what followed the earlier [1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    exact = target_distribution(target, prompt, params, vocab)
    counts = torch.zeros(vocab, vocab)
    accepted = 0
    for seed in range(n):
        params.seed = seed
        (a, b), stats = prompt_lookup_generate(target, prompt, params, k=2)
        counts[a, b] += 1
        accepted += stats.accepted
    assert 0 < accepted < n  # both branches of the rule ran: some kept, some rejected
    statistic, critical = chi_square(counts, exact)
    assert statistic < critical, "prompt-lookup sampling does not follow the target"
