"""Generation without a cache: every step re-runs the whole sequence.

This is the O(n^2) baseline that chapter 02's KV cache beats.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from minillm.model import Transformer
from minillm.sampling import SamplingParams, make_generator, sample


def check_length(model: Transformer, prompt_len: int, max_tokens: int) -> None:
    """Refuse a request that would run past the positions the model was trained on."""
    limit = model.config.max_position_embeddings
    if prompt_len == 0:
        raise ValueError("empty prompt: give at least one token")
    if prompt_len + max_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {limit} positions: shorten the prompt or lower max_tokens"
        )


def stop_ids(model: Transformer, params: SamplingParams) -> set[int]:
    """Token ids that end generation: the model's EOS (unless ignored) and stop_token_ids."""
    eos = model.config.eos_token_id
    eos = [] if eos is None or params.ignore_eos else [eos] if isinstance(eos, int) else eos
    return {*eos, *params.stop_token_ids}


@torch.inference_mode()
def generate_naive(
    model: Transformer,
    prompt_ids: Iterable[int],
    params: SamplingParams,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generated token ids (the prompt excluded); stops on EOS or after max_tokens."""
    ids = torch.tensor([list(prompt_ids)], device=model.lm_head.weight.device)
    check_length(model, ids.shape[1], params.max_tokens)
    generator = make_generator(params.seed, ids.device)
    stops, out = stop_ids(model, params), []
    for _ in range(params.max_tokens):
        logits = model(ids)[:, -1]  # the whole sequence again, every step
        token = sample(logits, params, generator)
        out.append(int(token))
        if on_token is not None:
            on_token(out[-1])
        if out[-1] in stops:
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    return out
