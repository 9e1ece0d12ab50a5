"""`SamplingParams`: how to pick each next token and when to stop, with vLLM's names,
defaults and checks (every number finite and in range, seeds that fit for every sample),
so a bad value is refused where it is given, not inside a step it would share with others."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # vLLM's RequestOutputKind, lower-case
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, with vLLM's names and defaults:
    `from minillm import LLM, SamplingParams` runs vLLM's quick-start code. `temperature=0`
    means greedy. Every generator of the course reads these; the engine also reads `n`,
    `best_of`, `stop` strings, `logprobs`, `prompt_logprobs` and `output_kind`."""

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
    # Penalties, as vLLM defines them (processors.py): presence and frequency count the
    # generated tokens (OpenAI's definition), repetition the prompt's and the generated ones.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # no stop token or stop string ends the sequence before this many
    logprobs: int | None = None  # per generated token: its logprob and the top-k's
    prompt_logprobs: int | None = None  # the same for every prompt token (the first: None)
    best_of: int | None = None  # generate this many, return the n most likely (vLLM V0)

    def __post_init__(self) -> None:
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"temperature={self.temperature} must be a finite number >= 0 (0 means greedy)",
        )
        _check(
            math.isfinite(self.top_p) and 0 < self.top_p <= 1,
            f"top_p={self.top_p} must be in (0, 1] (1 disables it)",
        )
        _check(self.top_k >= -1, f"top_k={self.top_k} must be >= 1, or 0/-1 to disable it")
        _check(self.max_tokens >= 1, f"max_tokens={self.max_tokens} must be >= 1")
        _check(self.n >= 1, f"n={self.n} must be >= 1 (samples per prompt)")
        _check(
            self.best_of is None or self.best_of >= self.n,
            f"best_of={self.best_of} must be >= n={self.n}",
        )
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED + 1 - self.num_samples:
            raise ValueError(
                f"seed={self.seed}: sample i uses seed + i, which must fit in [0, 2**63): "
                f"give a seed between 0 and {MAX_SEED + 1 - self.num_samples}"
            )
        _check(
            self.output_kind in OUTPUT_KINDS,
            f"output_kind={self.output_kind!r}: use one of {OUTPUT_KINDS}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                math.isfinite(value) and -2 <= value <= 2,
                f"{name}={value} must be a number in [-2, 2] (0 disables it)",
            )
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty={self.repetition_penalty} must be a finite number > 0 (1: none)",
        )
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, f"{name}={value} must be >= 0 (or None)")
        self.logit_bias = _checked_bias(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        bad = [t for t in self.stop_token_ids if t < 0]
        _check(not bad, f"stop_token_ids {bad} must be token ids (>= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences the engine generates: best_of when it is above n (the n best are kept)."""
        return max(self.n, self.best_of or 1)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the draw (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def needs_logprobs(self) -> bool:
        """Whether each sampled token's logprob is computed: asked for, or to rank best_of."""
        return self.logprobs is not None or self.num_samples > self.n


def greedy_params(max_tokens: int, **kw) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS does not stop it): what a
    benchmark or a parity check runs, so every request does the same work."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _checked_bias(bias: dict[int, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for token, value in bias.items():
        _check(
            isinstance(token, int) and not isinstance(token, bool) and token >= 0,
            f"logit_bias key {token!r} must be a token id (an integer >= 0)",
        )
        _check(
            math.isfinite(value) and -100 <= value <= 100,
            f"logit_bias[{token}]={value} must be a number in [-100, 100]",
        )
        out[token] = float(value)
    return out
