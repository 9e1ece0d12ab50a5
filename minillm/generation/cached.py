"""Generation: the naive loop (chapter 01) and the cached one (chapter 02).

`generate_naive` re-runs the whole sequence every step: O(n^2) work for n tokens.
`generate` runs the prompt once (prefill), keeps every token's K/V in a KVCache,
and then runs one token per step (decode): O(n) projections and MLPs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from minillm.cache.contiguous import KVCache
from minillm.generation.loop import (
    check_generate_params,
    check_length,
    finish_reason,
    sample_loop,
    stop_ids,
)
from minillm.generation.processors import History
from minillm.generation.sampling import SamplingParams, make_generator, sample
from minillm.model.transformer import Transformer


@torch.inference_mode()
def generate_naive(
    model: Transformer,
    prompt_ids: Iterable[int],
    params: SamplingParams,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generated token ids (the prompt excluded); stops on EOS or after max_tokens."""
    prompt = list(prompt_ids)
    ids = torch.tensor([prompt], device=model.lm_head.weight.device)
    check_length(model, ids.shape[1], params.max_tokens)
    check_generate_params(params)
    generator = make_generator(params.seed, ids.device)
    stops, out = stop_ids(model, params), []
    for _ in range(params.max_tokens):
        logits = model(ids)[:, -1]  # the whole sequence again, every step
        token = sample(logits, params, generator, [History(prompt + out, len(prompt), stops)])
        out.append(int(token))
        if on_token is not None:
            on_token(out[-1])
        if finish_reason(out[-1], len(out), params, stops) is not None:
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    return out


def prefill(
    model: Transformer, prompts: list[list[int]], max_tokens: int, kv_cache_dtype: str = "auto"
) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """Run the prompts, right-padded into one batch, through the model once, filling a new
    cache of longest + max_tokens slots (`kv_cache_dtype`: see `minillm.cache.kv_quant`).
    Returns (cache, each row's last logits [B, vocab], each row's length [B]: where its
    next token goes); cache.kv_len = longest prompt."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    for p in prompts:
        check_length(model, len(p), max_tokens)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    batch, longest = len(prompts), int(lengths.max())
    cache = KVCache(model.config, batch, longest + max_tokens, dtype, device, kv_cache_dtype)
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


def decode(
    model: Transformer,
    cache: KVCache,
    logits: torch.Tensor,
    positions: torch.Tensor,
    params: SamplingParams,
    step: Callable[[Transformer, KVCache, torch.Tensor, torch.Tensor], torch.Tensor],
    on_token: Callable[[int, int], None] | None = None,
    prompts: list[list[int]] | None = None,
) -> list[list[int]]:
    """`sample_loop` over a model step(model, cache, tokens [B, 1], positions [B, 1]);
    `prompts` for the penalties that read them."""
    generators = [make_generator(params.seed, positions.device) for _ in range(len(positions))]

    def next_logits(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal positions
        logits = step(model, cache, tokens[:, None], positions[:, None])
        positions = positions + 1  # a new tensor: a compiled step may hold the old one
        return logits

    stops = stop_ids(model, params)
    return sample_loop(logits, params, next_logits, stops, generators, on_token, prompts)


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    on_token: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """Generated ids for each prompt (prompts may differ in length), with a KV cache:
    one prefill forward for all prompts, then one decode forward per new token.
    `on_token(row, token)` is called with each token as it is produced (streaming)."""
    cache, logits, positions = prefill(model, prompts, params.max_tokens)
    return decode(model, cache, logits, positions, params, eager_decode_step, on_token, prompts)
