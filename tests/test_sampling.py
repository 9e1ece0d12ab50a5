"""Sampling: greedy is argmax, filters keep what they promise, seeds reproduce."""

import pytest
import torch

from minillm.generation import SamplingParams
from minillm.generation.sampling import make_generator, sample, top_k_filter, top_p_filter


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 5.0]])
    kept = top_k_filter(logits, 2).isfinite()
    assert kept.tolist() == [[False, True, False, False, True]]
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = top_p_filter(probs.log(), 0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = top_p_filter(probs.log(), 0.81).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    assert top_p_filter(probs.log(), 1e-6).isfinite().sum() == 1


def test_sampling_never_picks_filtered_tokens_and_seed_reproduces():
    logits = torch.randn(2, 100)
    params = SamplingParams(temperature=1.5, top_k=5, seed=7)
    draws = torch.stack([sample(logits, params, make_generator(i)) for i in range(200)])
    allowed = logits.topk(5, dim=-1).indices
    for row in range(2):
        assert set(draws[:, row].tolist()) <= set(allowed[row].tolist())
    a = [sample(logits, params, make_generator(3)).tolist() for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_low_temperature_approaches_greedy():
    logits = torch.randn(1, 30)
    params = SamplingParams(temperature=1e-4, seed=0)
    assert int(sample(logits, params, make_generator(0))) == int(logits.argmax())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
