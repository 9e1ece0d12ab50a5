"""What happens to a row of logits between the model and the draw, and the log-probabilities
reported with each token, as vLLM defines them.

In vLLM V1's order (its `Sampler.forward`):

1. `min_tokens`: while a sequence has fewer generated tokens than that, its stop tokens
   (EOS unless ignored, and `stop_token_ids`) get -inf, so they cannot be drawn;
2. `logit_bias`: each listed token's bias is added to its logit;
3. penalties (vLLM's `apply_penalties`): a logit of a token seen in the prompt *or* the
   output is divided by `repetition_penalty` when positive and multiplied by it otherwise
   (the CTRL paper's rule); then `frequency_penalty` times the token's count in the output
   and `presence_penalty` once if it is in the output are subtracted (OpenAI's definition:
   generated tokens only).

Greedy decoding takes the argmax of the adjusted logits, so all of these change greedy
output too.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from minillm.generation.params import SamplingParams


@dataclass
class History:
    """What the adjustments read of one sequence: its tokens (prompt, then generated) and
    the ids that would stop it (for min_tokens)."""

    token_ids: Sequence[int]
    num_prompt_tokens: int
    stop_ids: Collection[int] = ()

    @property
    def output_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class Logprob:
    """One token's log-probability and its rank in the distribution (1 = most likely), as
    vLLM's `Logprob`."""

    logprob: float
    rank: int


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, histories: Sequence[History] | None
) -> torch.Tensor:
    """min_tokens, logit_bias, then penalties, on a float32 copy of `logits` [B, vocab]."""
    logits = logits.float().clone()
    needs_history = params.min_tokens or params.repetition_penalty != 1
    needs_history = needs_history or params.presence_penalty or params.frequency_penalty
    if needs_history and (histories is None or len(histories) != logits.shape[0]):
        raise ValueError(
            "penalties and min_tokens read the tokens so far: pass one History per row "
            "(generate(..., prompts) does it)"
        )
    vocab = logits.shape[-1]
    if params.min_tokens:
        for row, h in enumerate(histories):
            stops = [t for t in h.stop_ids if t < vocab]
            if len(h.output_ids) < params.min_tokens and stops:
                logits[row, stops] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
    if needs_history and (
        params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
    ):
        for row, h in enumerate(histories):
            logits[row] = _penalize(logits[row], h, params)
    return logits


def _penalize(logits: torch.Tensor, h: History, params: SamplingParams) -> torch.Tensor:
    """vLLM's `apply_penalties` on one row."""
    vocab, device = logits.shape[-1], logits.device
    output = torch.tensor(h.output_ids, dtype=torch.long, device=device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].float()
    in_output = counts > 0
    if params.repetition_penalty != 1:
        seen = in_output.clone()
        prompt = h.token_ids[: h.num_prompt_tokens]
        prompt = torch.tensor(prompt, dtype=torch.long, device=device)
        seen[prompt[prompt < vocab]] = True
        penalty = torch.where(seen, params.repetition_penalty, 1.0)
        logits = logits * torch.where(logits > 0, 1.0 / penalty, penalty)
    return logits - params.frequency_penalty * counts - params.presence_penalty * in_output


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[dict[int, Logprob]]:
    """For each row of `logits` [m, vocab] (the model's raw logits) and its token: a dict
    holding that token first, then the k most likely tokens, best first (vLLM's shape: the
    chosen token may also be among the top k, so a dict has k or k + 1 entries)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    own = logp.gather(-1, chosen[:, None])
    ranks = ((logp > own).sum(dim=-1) + 1).tolist()
    own = own[:, 0].tolist()
    top_lp, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1) if k else (None, None)
    out = []
    for row, token in enumerate(tokens):
        entry = {int(token): Logprob(own[row], ranks[row])}
        if top_ids is not None:
            for rank, (t, lp) in enumerate(
                zip(top_ids[row].tolist(), top_lp[row].tolist(), strict=True), start=1
            ):
                entry.setdefault(t, Logprob(lp, rank))
        out.append(entry)
    return out
