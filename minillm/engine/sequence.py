"""One generated sequence: its tokens, its sampling state and where it is in its life.

A request with `n` samples becomes `n` sequences (a parent and `n - 1` children forked
from it after the prompt's prefill). The scheduler moves sequences between WAITING and
RUNNING; a preempted sequence goes back to WAITING with every token it has so far and
recomputes them when it is admitted again (its RNG keeps its state, so a seeded sample
continues exactly where it stopped).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from minillm.generation.sampling import SamplingParams as _BaseSamplingParams
from minillm.generation.sampling import make_generator


@dataclass
class SamplingParams(_BaseSamplingParams):
    """vLLM's SamplingParams subset: minillm's sampling knobs plus `n` samples per prompt
    and `stop` strings (the stop string itself is left out of the text, as in vLLM)."""

    n: int = 1
    stop: str | list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1 (samples per prompt)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]


def as_engine_params(params: _BaseSamplingParams | None) -> SamplingParams:
    """Accept minillm.SamplingParams too (n=1, no stop strings)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    return SamplingParams(**{k: getattr(params, k) for k in params.__dataclass_fields__})


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output), status and per-sequence sampling state."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    index: int = 0  # which of the request's n samples
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preemptions: int = 0
    children: list[Sequence] = field(default_factory=list)  # forked after the prefill
    text: str = ""  # detokenized output, cut at a stop string once one appears
    token_times: list[float] = field(default_factory=list)  # wall time of each output token
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        seed = None if self.params.seed is None else self.params.seed + self.index
        self.generator = make_generator(seed)

    @property
    def token_ids(self) -> list[int]:
        """Every token the model has to have seen: the prompt and the output so far."""
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_times.append(time.perf_counter())

    def fork(self, index: int) -> Sequence:
        """A child sample: same tokens so far, its own seed and RNG."""
        child = Sequence(list(self.prompt_ids), self.params, self.request_id, index)
        child.output_ids = list(self.output_ids)
        return child
