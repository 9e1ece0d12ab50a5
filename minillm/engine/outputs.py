"""What the engine hands back for a request, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.generation.processors import Logprob

# One position's log-probabilities: the token's own entry first, then the top k (vLLM's).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request. With output_kind "delta", `text` and `token_ids` hold only
    what is new since the request's previous output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # per token of token_ids (params.logprobs)
    cumulative_logprob: float | None = None  # of all tokens so far (with logprobs or best_of)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall times (time.perf_counter) for the serving metrics: TTFT, ITL, E2E."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # of sample 0


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt, its samples, finished or not."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # Prompt tokens' logprobs (params.prompt_logprobs): None for the first token, then one
    # entry per token; sent once, with the request's first output.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None  # set when the request failed inside the engine and was aborted
