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


def prefill(
    model: Transformer, prompts: list[list[int]], max_tokens: int
) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """Run the prompts, right-padded into one batch, through the model once, filling a new
    cache of longest + max_tokens slots. Returns (cache, each row's last logits [B, vocab],
    each row's length [B]: where its next token goes); cache.kv_len = longest prompt."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    for p in prompts:
        check_length(model, len(p), max_tokens)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    batch, longest = len(prompts), int(lengths.max())
    cache = KVCache(model.config, batch, longest + max_tokens, dtype, device)
    ids = torch.zeros(batch, longest, dtype=torch.long, device=device)  # padding: any id
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)
    cache.kv_len = longest  # prefill reads only the prompt slots
    logits = model(ids, cache=cache)[torch.arange(batch, device=device), lengths - 1]
    return cache, logits, lengths


def eager_decode_step(
    model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Logits [B, vocab] for one new token per row (tokens, positions [B, 1]). The longest
    row grows by one slot per step, and attention reads only the slots filled so far."""
    cache.kv_len += 1
    return model(tokens, positions, cache=cache)[:, -1]


def sample_loop(
    logits: torch.Tensor,
    params: SamplingParams,
    step: Callable[[torch.Tensor], torch.Tensor],
    stops: set[int],
    generators: list[torch.Generator],
) -> list[list[int]]:
    """Sample a token per row from `logits` [B, vocab], give the tokens [B] to `step` for the
    next logits, repeat: each row stops at a stop token or after max_tokens (finished rows
    ride along, their tokens unused). Every generation loop of the course (cached, compiled,
    paged, ONNX Runtime) is this loop with its own `step`."""
    out, done = [[] for _ in generators], [False] * len(generators)
    for i in range(params.max_tokens):
        tokens = _sample_rows(logits, params, generators)
        for b, token in enumerate(tokens.tolist()):
            if not done[b]:
                out[b].append(token)
                done[b] = token in stops
        if all(done) or i == params.max_tokens - 1:
            break
        logits = step(tokens)
    return out


def decode(
    model: Transformer,
    cache: KVCache,
    logits: torch.Tensor,
    positions: torch.Tensor,
    params: SamplingParams,
    step: Callable[[Transformer, KVCache, torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[list[int]]:
    """`sample_loop` over a model step(model, cache, tokens [B, 1], positions [B, 1])."""
    generators = [make_generator(params.seed, positions.device) for _ in range(len(positions))]

    def next_logits(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal positions
        logits = step(model, cache, tokens[:, None], positions[:, None])
        positions = positions + 1  # a new tensor: a compiled step may hold the old one
        return logits

    return sample_loop(logits, params, next_logits, stop_ids(model, params), generators)


@torch.inference_mode()
def generate(
    model: Transformer, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Generated ids for each prompt (prompts may differ in length), with a KV cache:
    one prefill forward for all prompts, then one decode forward per new token."""
    cache, logits, positions = prefill(model, prompts, params.max_tokens)
    return decode(model, cache, logits, positions, params, eager_decode_step)
