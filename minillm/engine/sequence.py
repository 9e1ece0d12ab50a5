"""One generated sequence: the single owner of its tokens, its KV blocks, its sampling state
and where it is in its life.

A request with `n` samples becomes `n` sequences: a parent, and `n - 1` children forked from
it in the step that finishes the prompt, sharing its blocks. The scheduler moves sequences
between WAITING, RUNNING and SWAPPED. A sequence knows how many of its tokens are computed
(their K/V written), so a prompt can run in chunks and a preempted sequence resumes exactly
where it was: recomputed from its tokens, or swapped back in. Its RNG keeps its state
either way, so a seeded sample continues as if nothing happened.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from minillm.cache.block_manager import PagedSequence
from minillm.engine.detokenizer import Detokenizer
from minillm.generation.processors import History, Logprob
from minillm.generation.sampling import SamplingParams, make_generator


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence(PagedSequence):
    """Prompt and output tokens (one list, `token_ids`, read by the block manager), status,
    sampling state, detokenized text and per-token timestamps."""

    num_prompt_tokens: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    index: int = 0  # which of the request's n samples
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    detokenizer: Detokenizer | None = None
    token_times: list[float] = field(default_factory=list)  # wall time of each output token
    # The raw logprobs of each generated token (when params.logprobs is set), their sum, and
    # those of prompt tokens 1.. (params.prompt_logprobs; token 0 has nothing before it).
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    error: str | None = None  # why this sequence failed inside a step (its request aborts)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.generator is None:
            seed = None if self.params.seed is None else self.params.seed + self.index
            self.generator = make_generator(seed)
        # The prompt's logprobs need the logits of every prompt position: no cache hits.
        self.reads_prefix_cache = not self.needs_prompt_logprobs

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions whose logprobs are still to record (the request's first
        sequence records them, once: a recomputed prompt is not recorded again)."""
        want = self.params.prompt_logprobs is not None and self.index == 0
        return want and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def history(self, stop_ids: set[int]) -> History:
        """What penalties and min_tokens read (a view, no copy of the tokens)."""
        return History(self.token_ids, self.num_prompt_tokens, stop_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V the next forwards must compute (1 for a decoding sequence)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, logprobs: dict[int, Logprob] | None = None) -> None:
        self.token_ids.append(token)
        self.token_times.append(time.perf_counter())
        if logprobs is not None:
            self.cumulative_logprob += logprobs[token].logprob
            if self.params.logprobs is not None:
                self.logprobs.append(logprobs)

    def fork(self, index: int) -> Sequence:
        """A child sample with the same tokens so far, its own seed and RNG (its blocks are
        shared by the block manager's fork)."""
        return Sequence(
            list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            params=self.params,
            request_id=self.request_id,
            index=index,
            status=self.status,
        )
