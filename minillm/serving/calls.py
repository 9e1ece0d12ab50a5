"""What one HTTP request asks the engine for (`Call`: one `Job` per prompt), built and fully
checked from the raw body by `completion_call` and `chat_call`, in the server's thread pool;
and the server's shared state (`ServerState`, the app's `state.server`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from minillm.engine.llm_engine import Engine
from minillm.engine.outputs import PositionLogprobs
from minillm.generation.sampling import SamplingParams
from minillm.serving.async_engine import AsyncEngine
from minillm.serving.protocol import ApiError, ChatRequest, CompletionRequest
from minillm.serving.validation import (
    Prompt,
    chat_prompt,
    check_model,
    check_request,
    completion_prompts,
    include_usage,
    longest_token_chars,
    parse,
    sampling_params,
)

T = TypeVar("T")
# Parsing a 2 MiB body holds the GIL ~20 ms at a stretch (validation.PARSING says why):
# /health stays under 50 ms meanwhile (tests/test_server_reliability.py).
MAX_BODY_BYTES = 2 * 2**20
MAX_PROMPTS = 64  # prompts in one batched completion request


@dataclass
class ServerState:
    """Everything the routes share: the engine and its thread, the tokenizer, the limits,
    and the thread pool that parses, tokenizes and formats off the event loop."""

    engine: Engine
    model_name: str
    chat_template: str | None = None  # replaces the model's own (`serve --chat-template`)
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompts: int = MAX_PROMPTS
    core: AsyncEngine = field(init=False)
    pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.tokenizer, self.context = self.engine.tokenizer, self.engine.context
        self.token_chars = longest_token_chars(self.tokenizer)
        self.core = AsyncEngine(self.engine)
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="minillm-request")
        self._texts: dict[int, str] = {}

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the thread pool: the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def token_text(self, token: int) -> str:
        """One token's text, as vLLM reports it in logprobs (decoded alone), cached."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], False)
        return text


@dataclass(eq=False)
class Job:
    """One prompt of a call, as one engine request."""

    index: int  # the prompt's place in the request: its choices are index * n + j
    prompt: Prompt
    params: SamplingParams
    echo: bool = False  # the choice's text starts with the prompt (and its logprobs)
    echo_only: bool = False  # max_tokens=0: the prompt alone (one token is run, dropped)
    request_id: str = ""
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class Call:
    """The engine work of one HTTP request, and how to answer it."""

    jobs: list[Job]
    chat: bool
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the answer


def completion_call(raw: bytes, state: ServerState) -> Call:
    body = parse(raw, CompletionRequest)
    check_model(body.model, state.model_name)
    best_of, n = body.best_of, body.n
    if body.stream and best_of is not None and best_of > n:
        raise ApiError("best_of > n cannot be streamed (the best are known at the end)", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(
            "max_tokens=0 generates nothing: give max_tokens >= 1, or echo=true to score "
            "the prompt",
            "max_tokens",
        )
    prompts = completion_prompts(
        body, state.tokenizer, state.context, state.token_chars, state.max_prompts
    )
    echo_only = body.echo and body.max_tokens == 0
    prompt_logprobs = body.logprobs if body.echo else None
    jobs = []
    for i, prompt in enumerate(prompts):
        max_tokens = 1 if echo_only else body.max_tokens or max(state.context - len(prompt.ids), 1)
        params = sampling_params(
            body,
            max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=prompt_logprobs,
            best_of=best_of,
        )
        check_request(state.engine, prompt, params)
        if body.echo and prompt.text is None:
            prompt.text = state.tokenizer.decode(prompt.ids, body.skip_special_tokens)
        jobs.append(Job(i, prompt, params, body.echo, echo_only))
    return Call(jobs, False, n, body.stream, include_usage(body), body.logprobs)


def chat_call(raw: bytes, state: ServerState) -> Call:
    body = parse(raw, ChatRequest)
    check_model(body.model, state.model_name)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs needs logprobs=true", "top_logprobs")
    if (body.top_logprobs or 0) > state.engine.max_logprobs:
        raise ApiError(
            f"top_logprobs={body.top_logprobs} exceeds this server's maximum of "
            f"{state.engine.max_logprobs}",
            "top_logprobs",
        )
    prompt = chat_prompt(
        body.messages,
        body.add_generation_prompt,
        state.tokenizer,
        state.chat_template,
        state.context,
        state.token_chars,
    )
    max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:  # OpenAI's older name
        max_tokens, field = body.max_tokens, "max_tokens"
    elif body.max_tokens is not None and body.max_tokens != max_tokens:
        raise ApiError(
            f"max_completion_tokens={max_tokens} and max_tokens={body.max_tokens} disagree: "
            "send one of them (max_tokens is the older name)",
            "max_tokens",
        )
    if max_tokens == 0:
        raise ApiError(f"{field}=0 generates nothing: give {field} >= 1", field)
    max_tokens = max_tokens or max(state.context - len(prompt.ids), 1)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs=top)
    check_request(state.engine, prompt, params)
    return Call([Job(0, prompt, params)], True, body.n, body.stream, include_usage(body), top)
