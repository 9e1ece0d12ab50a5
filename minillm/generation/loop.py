"""The one sampling loop every generator of the course runs, with its stop policy and
its length check.

Cached, compiled, paged and ONNX Runtime generation differ only in how they get the next
logits (`step`); the sampling, the per-row RNGs, the stop tokens and max_tokens live here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.generation.processors import History
from minillm.generation.sampling import SamplingParams, sample
from minillm.model.transformer import Transformer


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


def finish_reason(
    token: int, num_generated: int, params: SamplingParams, stops: set[int]
) -> tuple[str, int | None] | None:
    """The one stop policy, after a sequence's `num_generated`-th token: ("stop", reason) on
    a stop token (EOS unless ignored: reason None; a stop_token_id: reason that id; within
    the first `min_tokens` tokens the sampler cannot draw one),
    ("length", None) once max_tokens are generated, None to go on. Stop strings are text,
    so the engine's detokenizer finds those."""
    if token in stops:
        return "stop", token if token in params.stop_token_ids else None
    if num_generated >= params.max_tokens:
        return "length", None
    return None


def check_generate_params(params: SamplingParams) -> None:
    """The generators return token ids only: refuse what only the engine can return."""
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError(
            "generate returns token ids only: for logprobs use the engine "
            "(minillm.LLM(...).generate or the server)"
        )
    if params.num_samples > params.n:
        raise ValueError("best_of needs the engine (minillm.LLM(...).generate or the server)")


def _sample_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    generators: list[torch.Generator],
    histories: list[History] | None,
) -> torch.Tensor:
    """One token per row; each row draws from its own RNG, so a seeded request gives the
    same tokens whether it runs alone or in a batch."""
    if params.greedy and not params.adjusts_logits:
        return logits.argmax(dim=-1)
    return torch.cat(
        [
            sample(logits[b : b + 1], params, g, histories and histories[b : b + 1])
            for b, g in enumerate(generators)
        ]
    )


def sample_loop(
    logits: torch.Tensor,
    params: SamplingParams,
    step: Callable[[torch.Tensor], torch.Tensor],
    stops: set[int],
    generators: list[torch.Generator],
    on_token: Callable[[int, int], None] | None = None,
    prompts: list[list[int]] | None = None,
) -> list[list[int]]:
    """Sample a token per row from `logits` [B, vocab], give the tokens [B] to `step` for the
    next logits, repeat: each row stops at a stop token or after max_tokens (finished rows
    ride along, their tokens unused). Every generation loop of the course (cached, compiled,
    paged, ONNX Runtime) is this loop with its own `step`. `on_token(row, token)` sees each
    kept token as soon as it is sampled: streaming. `prompts` (row b's prompt ids) are what
    repetition_penalty reads; presence/frequency penalties and min_tokens read the output."""
    check_generate_params(params)
    out, done = [[] for _ in generators], [False] * len(generators)
    if params.repetition_penalty != 1 and prompts is None:
        raise ValueError("repetition_penalty reads the prompt: pass prompts= to sample_loop")
    for i in range(params.max_tokens):
        histories = None
        if params.adjusts_logits:
            prompt = prompts or [[] for _ in generators]
            histories = [History(p + o, len(p), stops) for p, o in zip(prompt, out, strict=True)]
        tokens = _sample_rows(logits, params, generators, histories)
        for b, token in enumerate(tokens.tolist()):
            if not done[b]:
                out[b].append(token)
                done[b] = finish_reason(token, len(out[b]), params, stops) is not None
                if on_token is not None:
                    on_token(b, token)
        if all(done) or i == params.max_tokens - 1:
            break
        logits = step(tokens)
    return out
