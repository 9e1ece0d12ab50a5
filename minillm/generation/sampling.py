"""Sampling parameters with vLLM's names, and the token samplers they select."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # vLLM's RequestOutputKind, lower-case


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, with vLLM's names and defaults:
    `from minillm import LLM, SamplingParams` runs vLLM's quick-start code. `temperature=0`
    means greedy. Every generator of the course reads these; the engine also reads `n`
    (samples per prompt), `stop` strings and `output_kind`."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut (vLLM accepts both)
    seed: int | None = None  # sample i of a request draws with seed + i
    stop: str | list[str] | None = None  # the stop string is left out of the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int = 16
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # What each engine output carries: the whole text so far, only what is new since the
    # last output (streaming), or nothing until the request finishes.
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 disables it)")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or 0/-1 to disable it")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1 (samples per prompt)")
        if self.seed is not None and not 0 <= self.seed <= 2**63 - self.n:
            raise ValueError(
                f"seed={self.seed}: sample i uses seed + i, which must fit in [0, 2**63): "
                f"give a seed between 0 and {2**63 - self.n}"
            )
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind={self.output_kind!r}: use one of {OUTPUT_KINDS}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= p."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach p.
    drop = probs.cumsum(dim=-1) - probs >= p
    drop = drop.scatter(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, vocab]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from: temperature, then top-k, then top-p (fp32)."""
    if params.greedy:
        raise ValueError("greedy sampling (temperature=0) has no distribution: use argmax")
    logits = logits.float() / params.temperature
    return top_p_filter(top_k_filter(logits, params.top_k), params.top_p).softmax(dim=-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG so a seeded request is reproducible whatever else runs."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
