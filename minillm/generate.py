"""Generation: the naive loop (chapter 01) and the cached one (chapter 02).

`generate_naive` re-runs the whole sequence every step: O(n^2) work for n tokens.
`generate` runs the prompt once (prefill), keeps every token's K/V in a KVCache,
and then runs one token per step (decode): O(n) projections and MLPs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from minillm.kv_cache import KVCache
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


def _sample_rows(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> torch.Tensor:
    """One token per row; each row draws from its own RNG, so a seeded request gives the
    same tokens whether it runs alone or in a batch."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.cat([sample(logits[b : b + 1], params, g) for b, g in enumerate(generators)])


@torch.inference_mode()
def generate(
    model: Transformer, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Generated ids for each prompt (prompts may differ in length), with a KV cache.

    Prefill: the prompts, right-padded into one batch, go through the model once and fill
    the cache. Decode: each step feeds one new token per sequence at its own position.
    """
    device = model.lm_head.weight.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    for p in prompts:
        check_length(model, len(p), params.max_tokens)
    batch, longest = len(prompts), int(lengths.max())
    cache = KVCache(
        model.config, batch, longest + params.max_tokens, model.lm_head.weight.dtype, device
    )
    ids = torch.zeros(batch, longest, dtype=torch.long, device=device)  # padding: any id
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)

    cache.kv_len = longest
    logits = model(ids, cache=cache)  # prefill: all prompt tokens in one forward
    logits = logits[torch.arange(batch, device=device), lengths - 1]  # each row's last token
    generators = [make_generator(params.seed, device) for _ in prompts]
    stops, out = stop_ids(model, params), [[] for _ in prompts]
    done = [False] * batch
    positions = lengths.clone()  # where each sequence's next token goes
    for step in range(params.max_tokens):
        tokens = _sample_rows(logits, params, generators)
        for b, token in enumerate(tokens.tolist()):
            if not done[b]:
                out[b].append(token)
                done[b] = token in stops
        if all(done) or step == params.max_tokens - 1:
            break
        cache.kv_len = longest + step + 1  # slots filled so far, in the longest row
        logits = model(tokens[:, None], positions[:, None], cache=cache)[:, -1]  # decode
        positions += 1
    return out
