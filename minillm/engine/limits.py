"""What the engine refuses before a request is queued, so that nothing a request carries can
fail later inside a step it shares with others: an empty prompt or one past the context,
token ids outside the vocabulary (an embedding lookup would fail for the whole batch, or on
a GPU corrupt the device), more samples than the engine runs at once, more logprobs than
`max_logprobs`, more KV blocks than the pool has. The numbers of the sampling parameters
(finite, in range, seeds that fit) are `SamplingParams`' own check."""

from __future__ import annotations

from minillm.cache.block_manager import BlockManager
from minillm.generation.loop import check_length
from minillm.generation.sampling import SamplingParams
from minillm.model.transformer import Transformer


def check_request(
    model: Transformer,
    manager: BlockManager,
    max_num_seqs: int,
    max_logprobs: int,
    prompt_ids: list[int],
    params: SamplingParams,
) -> None:
    """Raise ValueError naming the fix if this request could never run here: empty, past
    the context, token ids outside the vocabulary, more samples than max_num_seqs, more
    logprobs than max_logprobs, or more KV blocks than the pool has."""
    check_length(model, len(prompt_ids), params.max_tokens)
    vocab = model.config.vocab_size
    bad = [(i, t) for i, t in enumerate(prompt_ids) if not _is_id(t, vocab)][:3]
    if bad:
        where = ", ".join(f"{t!r} at position {i}" for i, t in bad)
        raise ValueError(f"prompt token ids must be in [0, {vocab}): got {where}")
    bad = [t for t in [*params.stop_token_ids, *(params.logit_bias or ())] if t >= vocab]
    if bad:
        raise ValueError(
            f"token ids {sorted(set(bad))[:3]} in stop_token_ids/logit_bias are outside "
            f"the vocabulary [0, {vocab})"
        )
    if params.num_samples > max_num_seqs:
        asked = f"best_of={params.best_of}" if params.num_samples > params.n else f"n={params.n}"
        raise ValueError(
            f"{asked} exceeds max_num_seqs={max_num_seqs}: ask for fewer "
            "samples or start the engine with more sequences"
        )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise ValueError(
                f"{name}={k} exceeds max_logprobs={max_logprobs}: ask for fewer, "
                "or start the engine with a larger max_logprobs"
            )
    need = manager.blocks_for(len(prompt_ids) + params.max_tokens)
    if need > manager.num_blocks:
        raise ValueError(
            f"prompt + max_tokens needs {need} KV blocks but the pool has "
            f"{manager.num_blocks}: lower max_tokens or give the engine more blocks"
        )


def _is_id(token: object, vocab: int) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab
