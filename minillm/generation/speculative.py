"""Speculative decoding: a small draft model guesses k tokens, the target checks them in one go.

A decode step of a large model costs about as much for 1 token as for 5: at batch 1 it is
bound by reading the weights, not by arithmetic. So let a cheap draft model propose k
tokens one by one, then run the target once over all k. Where the target agrees with a
proposal it is kept; at the first disagreement the target's own choice replaces it. Every
round therefore yields between 1 and k + 1 tokens for one target forward.

- Greedy (temperature 0): a proposal is kept when it is the target's argmax, so the output
  is exactly the target's greedy output, whatever the draft.
- Sampling: proposal x drawn from the draft's q is kept with probability min(1, p(x)/q(x));
  on rejection the token is drawn from max(0, p - q), renormalised. The tokens are then
  distributed exactly as sampling from the target's p alone (Leviathan et al. 2023,
  Chen et al. 2023), which `tests/test_speculative.py` checks by counting.

The speed-up needs two things the output does not show: a draft that agrees often (the
acceptance rate) and a draft much cheaper than the target. Chapter 10 measures both.

Who proposes is pluggable (`Proposer`): a draft model here, or prompt lookup
(`minillm.generation.lookup`), which proposes the tokens that followed an earlier
occurrence of the last few tokens and needs no model at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from minillm.cache.contiguous import KVCache
from minillm.generation.loop import check_length, stop_ids
from minillm.generation.sampling import SamplingParams, make_generator, probabilities
from minillm.model.transformer import Transformer

Pick = Callable[[torch.Tensor], tuple[int, torch.Tensor | None]]  # logits -> token, its q
Proposal = tuple[list[int], list[torch.Tensor | None]]  # tokens, the q each was drawn from


@dataclass
class SpecStats:
    """What one speculative generation did: rounds, draft proposals and how many were kept."""

    rounds: int = 0  # target forwards after the prefill (one per round)
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended on a rejection (the rest kept all k)
    draft_forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        """a: the chance the target keeps a proposal it checks. Proposals after a rejection
        are never checked, so this is accepted / (accepted + rejected), not / proposed."""
        checked = self.accepted + self.rejected
        return self.accepted / checked if checked else 0.0

    @property
    def kept_fraction(self) -> float:
        """Share of all proposals kept: the draft work that was not wasted."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per target forward: 1 for plain decoding, up to k + 1 here."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


class _Runner:
    """One model with its own KV cache, and how many of the committed tokens it holds."""

    def __init__(self, model: Transformer, max_len: int) -> None:
        weight = model.lm_head.weight
        self.model = model
        self.cache = KVCache(model.config, 1, max_len, weight.dtype, weight.device)
        self.cached = 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] for tokens placed right after the cached ones."""
        device = self.cache.k.device
        positions = torch.arange(self.cached, self.cached + len(tokens), device=device)[None]
        self.cache.kv_len = self.cached + len(tokens)
        ids = torch.tensor([tokens], device=device)
        logits = self.model(ids, positions, cache=self.cache)[0]
        self.cached += len(tokens)
        return logits

    def keep(self, n: int) -> None:
        """Forget every cached token from position n on (rejected proposals). Their slots
        hold junk until overwritten; the causal mask never lets a query read past itself."""
        self.cached = min(self.cached, n)


def verify(
    target_logits: torch.Tensor,
    proposal: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """The acceptance rule: (how many proposals to keep, the token that follows them).

    target_logits [k + 1, vocab]: the target's logits after the last committed token and
    after each of the k proposals. draft_probs [k, vocab]: the distribution each proposal
    was drawn from (None when greedy).
    """
    k = len(proposal)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} rows of target logits, got {target_logits.shape}")
    if params.greedy:
        choice = target_logits.argmax(-1).tolist()
        kept = next((i for i in range(k) if choice[i] != proposal[i]), k)
        return kept, choice[kept]
    if draft_probs is None or draft_probs.shape[0] != k:
        raise ValueError("sampling needs the draft's distribution for each proposal")
    p = probabilities(target_logits, params)
    for i, token in enumerate(proposal):
        u = torch.rand((), generator=generator, device=p.device)
        if u * draft_probs[i, token] < p[i, token]:  # kept with probability min(1, p/q)
            continue
        residual = (p[i] - draft_probs[i]).clamp(min=0)
        residual = residual if residual.sum() > 0 else p[i]  # p == q: rejection is impossible
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


class Proposer(Protocol):
    """Where a round's proposals come from: a draft model (`DraftProposer`) or a lookup in
    the text so far (`minillm.generation.lookup.NgramProposer`)."""

    def propose(self, tokens: list[int], k: int, pick: Pick, stats: SpecStats) -> Proposal:
        """Up to k proposed tokens to follow `tokens` (the committed ones), each with the
        distribution it was drawn from (None when greedy)."""
        ...

    def keep(self, n: int) -> None:
        """The first n tokens are committed (forget state past them)."""
        ...


class DraftProposer:
    """A small model with its own KV cache proposes k tokens, one forward each."""

    def __init__(self, draft: Transformer, max_len: int) -> None:
        self.runner = _Runner(draft, max_len)

    def propose(self, tokens: list[int], k: int, pick: Pick, stats: SpecStats) -> Proposal:
        proposal: list[int] = []
        q_rows: list[torch.Tensor | None] = []
        logits = self.runner.feed(tokens[self.runner.cached :])[-1]
        for i in range(k):
            token, q = pick(logits)
            proposal.append(token)
            q_rows.append(q)
            if i < k - 1:
                logits = self.runner.feed([token])[-1]
            stats.draft_forwards += 1
        return proposal, q_rows

    def keep(self, n: int) -> None:
        self.runner.keep(n)


@torch.inference_mode()
def speculate(
    target: Transformer, proposer: Proposer, prompt: list[int], params: SamplingParams, k: int
) -> tuple[list[int], SpecStats]:
    """The speculative loop, whatever proposes: each round, up to k proposals, one target
    forward over all of them, `verify`, commit the kept tokens and the target's next one.
    Stops like every generator of the course (`stop_ids`: EOS unless ignored, stop tokens,
    max_tokens)."""
    if k < 1:
        raise ValueError(f"k={k}: propose at least one token per round (plain decoding is k=0)")
    if params.adjusts_logits or params.logprobs is not None or params.num_samples > params.n:
        raise ValueError(
            "speculative decoding here verifies against the model's plain distribution: "
            "penalties, logit_bias, min_tokens, logprobs and best_of are not supported "
            "(use minillm.generate or the engine)"
        )
    check_length(target, len(prompt), params.max_tokens)
    tgt = _Runner(target, len(prompt) + params.max_tokens)
    generator = None if params.greedy else make_generator(params.seed, target.lm_head.weight.device)
    stops, stats = stop_ids(target, params), SpecStats()
    tokens, out = list(prompt), []

    def pick(logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if params.greedy:
            return int(logits.argmax()), None
        q = probabilities(logits, params)
        return int(torch.multinomial(q, 1, generator=generator)), q

    while len(out) < params.max_tokens:
        # A round emits up to k_r + 1 tokens: never propose past max_tokens.
        k_r = min(k, params.max_tokens - len(out) - 1)
        proposal, q_rows = proposer.propose(tokens, k_r, pick, stats) if k_r > 0 else ([], [])
        k_r = len(proposal)  # a lookup may find fewer than k (or none: a plain decode step)
        target_logits = tgt.feed(tokens[tgt.cached :] + proposal)[-(k_r + 1) :]
        q = None if params.greedy or not proposal else torch.stack(q_rows)
        if not proposal and not params.greedy:  # nothing proposed: plain sampling
            kept, nxt = 0, pick(target_logits[0])[0]
        else:
            kept, nxt = verify(target_logits, proposal, q, params, generator)
        stats.rounds += 1
        stats.proposed += k_r
        stats.accepted += kept
        stats.rejected += kept < k_r
        for token in proposal[:kept] + [nxt]:
            out.append(token)
            tokens.append(token)
            if token in stops:
                return out, stats
        tgt.keep(len(tokens) - 1)  # every cache holds all committed tokens but the last
        proposer.keep(len(tokens) - 1)
    return out, stats


def speculative_generate(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    params: SamplingParams,
    k: int = 4,
) -> tuple[list[int], SpecStats]:
    """Generate like `generate(target, [prompt], params)[0]`, with `draft` proposing k tokens
    per round. Returns the new tokens and what the rounds did."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}): a draft must share the target's tokenizer "
            "(train one with `python -m minillm.training.train --tokenizer <target dir>`, "
            "or use prompt lookup: `minillm.generation.lookup.prompt_lookup_generate`)"
        )
    check_length(draft, len(prompt), params.max_tokens)
    proposer = DraftProposer(draft, len(prompt) + params.max_tokens)
    return speculate(target, proposer, prompt, params, k)


def predicted_speedup(acceptance: float, k: int, draft_cost: float) -> float:
    """Speed-up over plain decoding in Leviathan et al.'s cost model: a round yields
    (1 - a^(k+1)) / (1 - a) tokens for k draft forwards (cost c each, in target forwards)
    and one target forward over k + 1 tokens (cost 1: decode reads weights, not FLOPs)."""
    if not 0 <= acceptance <= 1 or k < 0 or draft_cost < 0:
        raise ValueError(
            f"need 0 <= acceptance <= 1, k >= 0, draft_cost >= 0: got "
            f"{acceptance}, {k}, {draft_cost}"
        )
    tokens = k + 1 if acceptance == 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return tokens / (k * draft_cost + 1)
