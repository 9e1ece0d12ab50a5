"""Answering a call: `complete` gathers the engine's outputs into one JSON response,
`stream` sends them as server-sent events as they come (`data: {...}`, ending with
`data: [DONE]`).

Both read `results`, which submits the call's jobs to the engine thread and yields their
outputs from one queue until every job has finished. Whatever ends the consumer (the
response is done, the client disconnected, the server is stopping) aborts what is still
running, which frees its KV blocks at once. A job that failed in the engine ends the call:
`complete` answers with an error status, `stream` with the failed choices' "abort" finish
and an error event, and the other requests of the server never notice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from minillm.engine.outputs import CompletionOutput, RequestOutput
from minillm.serving.async_engine import SHUTDOWN_ERROR
from minillm.serving.calls import Call, Job, ServerState
from minillm.serving.formatting import Choice, Piece, choice_json, usage
from minillm.serving.protocol import ApiError, error_body


async def results(state: ServerState, call: Call) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Submit the call's jobs and yield (job, output) until all are finished; aborts the
    unfinished ones when the consumer stops early."""
    loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

    def deliver(out: RequestOutput) -> None:  # on the engine thread
        loop.call_soon_threadsafe(outputs.put_nowait, out)

    jobs = {}
    for job in call.jobs:
        job.request_id = state.core.add(job.prompt.ids, job.params, deliver)
        jobs[job.request_id] = job
    running, timed = set(jobs), set()
    try:
        while running:
            out = await outputs.get()
            if out.error is not None:
                status = 503 if out.error == SHUTDOWN_ERROR else 500
                raise ApiError(out.error, None, status)
            ttft = out.metrics.first_token_time
            if ttft is not None and out.request_id not in timed:
                timed.add(out.request_id)
                state.core.metrics.observe_ttft(ttft - out.metrics.arrival_time)
            if out.finished:
                running.discard(out.request_id)
            yield jobs[out.request_id], out
    finally:
        for request_id in running:
            state.core.abort(request_id)


def piece_of(job: Job, out: RequestOutput, o: CompletionOutput) -> Piece | None:
    """What output `o` of `job` adds to its choice (None: nothing yet). With echo_only
    (max_tokens 0) the choice is the prompt alone, once the request is done (the one token
    the engine ran is dropped)."""
    if out.prompt_logprobs is not None:
        job.prompt_logprobs = out.prompt_logprobs
    if job.echo_only:
        return prompt_piece(job, "length") if o.finish_reason is not None else None
    entries = o.logprobs if o.logprobs is not None else [None] * len(o.token_ids)
    return Piece(
        o.text, list(o.token_ids), list(entries), o.finish_reason, o.stop_reason, len(o.token_ids)
    )


def prompt_piece(job: Job, finish_reason: str | None = None) -> Piece:
    """The prompt, as echo writes it before the completion: its text, ids and logprobs
    (the first token has none: nothing comes before it)."""
    entries = job.prompt_logprobs or [None] * len(job.prompt.ids)
    return Piece(job.prompt.text or "", list(job.prompt.ids), list(entries), finish_reason)


def _choices(call: Call) -> dict[int, Choice]:
    """Prompt i's sample j is choice i * n + j, as in OpenAI's API."""
    numbers = [job.index * call.n + j for job in call.jobs for j in range(call.n)]
    return {number: Choice(number) for number in numbers}


async def complete(state: ServerState, request: Request, call: Call) -> Response:
    """The whole answer as one JSON response (a client that disconnects meanwhile aborts
    it: 499, as nginx logs it)."""
    choices = _choices(call)

    async def collect() -> None:
        async for job, out in results(state, call):
            for o in out.outputs:
                piece = piece_of(job, out, o)
                if piece is not None:
                    choices[job.index * call.n + o.index].add(piece)

    gathering = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({gathering, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not gathering.done():
        gathering.cancel()  # the client left: abort, free the blocks
        return Response(status_code=499)
    gone.cancel()
    gathering.result()  # an engine failure raises its ApiError here
    body = await state.run(_whole, state, call, choices)
    return Response(body, media_type="application/json")


def _whole(state: ServerState, call: Call, choices: dict[int, Choice]) -> bytes:
    """The response body (built in the thread pool: token texts, JSON)."""
    out = []
    for number, choice in sorted(choices.items()):
        job = call.jobs[number // call.n]
        if job.echo and not job.echo_only:  # its prompt logprobs came with the outputs
            choice.pieces.insert(0, prompt_piece(job))
        part = choice_json(
            choice, choice.take(), call.chat, False, call.top_logprobs, state.token_text
        )
        out.append(part)
    generated = sum(c.num_generated for c in choices.values())
    body = {**_head(state, call), "choices": out, "usage": usage(_prompt_tokens(call), generated)}
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def stream(state: ServerState, call: Call) -> StreamingResponse:
    """Server-sent events: a chunk per output that adds text (or ends a choice), an
    error event if the call fails, the usage chunk if asked, then [DONE]."""
    choices, head = _choices(call), _head(state, call)

    def sse(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def chunk(choice: Choice) -> str:
        part = choice_json(
            choice, choice.take(), call.chat, True, call.top_logprobs, state.token_text
        )
        return sse({**head, "choices": [part]})

    async def events() -> AsyncIterator[str]:
        failed, echoed = None, set()
        try:
            async for job, out in results(state, call):
                for o in out.outputs:
                    choice = choices[job.index * call.n + o.index]
                    piece = piece_of(job, out, o)
                    if piece is None or choice.finish_reason is not None:
                        continue
                    if job.echo and not job.echo_only and choice.index not in echoed:
                        echoed.add(choice.index)  # the prompt goes before the first text
                        choice.add(prompt_piece(job))
                    choice.add(piece)
                    if piece.text or piece.finish_reason is not None:  # else: wait for text
                        yield chunk(choice)
        except ApiError as err:
            failed = err
        if failed is not None:  # the failed choices end with "abort", then the error
            for choice in choices.values():
                if choice.finish_reason is None:
                    choice.add(Piece(finish_reason="abort"))
                    yield chunk(choice)
            yield sse(error_body(str(failed), failed.param, failed.status))
        elif call.include_usage:
            generated = sum(c.num_generated for c in choices.values())
            yield sse({**head, "choices": [], "usage": usage(_prompt_tokens(call), generated)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _head(state: ServerState, call: Call) -> dict:
    kind = "chat.completion" if call.chat else "text_completion"
    if call.chat and call.stream:
        kind = "chat.completion.chunk"
    prefix = "chatcmpl-" if call.chat else "cmpl-"
    return {
        "id": prefix + uuid.uuid4().hex,
        "object": kind,
        "created": int(time.time()),
        "model": state.model_name,
    }


def _prompt_tokens(call: Call) -> int:
    return sum(len(job.prompt.ids) for job in call.jobs)


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
