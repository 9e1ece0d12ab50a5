"""Naive generation: stops where it should, refuses what it can't do, reproduces with a seed."""

import pytest
import torch

from minillm import SamplingParams, generate_naive


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(max_position_embeddings=64, eos_token_id=3)


def test_greedy_equals_argmax_of_full_forward(model):
    out = generate_naive(
        model, [1, 2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    ids = [1, 2]
    for _ in range(6):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[2:]


def test_stops_on_eos_unless_ignored(model):
    first = generate_naive(model, [1], SamplingParams(temperature=0, max_tokens=1))[0]
    model.config.eos_token_id = first
    try:
        assert generate_naive(model, [1], SamplingParams(temperature=0, max_tokens=5)) == [first]
        long = generate_naive(
            model, [1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        )
        assert len(long) == 5
        stop = generate_naive(
            model,
            [1],
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop_token_ids=[first]),
        )
        assert stop == [first]
    finally:
        model.config.eos_token_id = 3


def test_seeded_sampling_reproduces(model):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=123, ignore_eos=True)
    assert generate_naive(model, [5], params) == generate_naive(model, [5], params)


def test_refuses_past_context_and_empty_prompt(model):
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        generate_naive(model, list(range(60)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="empty prompt"):
        generate_naive(model, [], SamplingParams())
