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
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
    """What output `o` of `job` adds to its choice (None: nothing yet). Echo puts the
    prompt, with its logprobs, before the first text; echo_only answers the prompt alone."""
    if out.prompt_logprobs is not None:
        job.prompt_logprobs = out.prompt_logprobs
    if job.echo_only:
        if o.finish_reason is None:
            return None
        prompt_entries = job.prompt_logprobs or [None] * len(job.prompt.ids)
        return Piece(job.prompt.text or "", list(job.prompt.ids), prompt_entries, "length")
    entries = o.logprobs if o.logprobs is not None else [None] * len(o.token_ids)
    return Piece(o.text, list(o.token_ids), list(entries), o.finish_reason, o.stop_reason)


def _choices(call: Call) -> dict[int, Choice]:
    return {
        j.index * call.n + i: Choice(j.index * call.n + i) for j in call.jobs for i in range(call.n)
    }


async def complete(state: ServerState, request: Request, call: Call) -> Response:
    """The whole answer as one JSON response (a client that disconnects meanwhile aborts
    it: 499, as nginx logs it)."""
    choices, head = _choices(call), _head(state, call)

    async def collect() -> None:
        async for job, out in results(state, call):
            for o in out.outputs:
                piece = piece_of(job, out, o)
                if piece is not None:
                    choices[job.index * call.n + o.index].add(piece)
                    choices[job.index * call.n + o.index].num_generated += len(o.token_ids) * (
                        not job.echo_only
                    )

    gathering = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({gathering, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not gathering.done():
        gathering.cancel()  # the client left: abort, free the blocks
        return Response(status_code=499)
    gone.cancel()
    gathering.result()  # an engine failure raises its ApiError here
    body = await state.run(_whole, state, call, choices, head)
    return Response(body, media_type="application/json")


def _whole(state: ServerState, call: Call, choices: dict[int, Choice], head: dict) -> bytes:
    """The response body (built in the thread pool: token texts, JSON)."""
    out = []
    for index in sorted(choices):
        piece = choices[index].take()
        job = call.jobs[index // call.n]
        if job.echo and not job.echo_only:
            prompt = job.prompt_logprobs or [None] * len(job.prompt.ids)
            piece = Piece(
                job.prompt.text + piece.text,
                job.prompt.ids + piece.ids,
                list(prompt) + piece.entries,
                piece.finish_reason,
                piece.stop_reason,
            )
        out.append(
            choice_json(
                choices[index], piece, call.chat, False, call.top_logprobs, state.token_text
            )
        )
    generated = sum(c.num_generated for c in choices.values())
    body = {**head, "choices": out, "usage": usage(_prompt_tokens(call), generated)}
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def stream(state: ServerState, call: Call) -> StreamingResponse:
    """Server-sent events: a chunk per output that adds text (or ends a choice), an
    error event if the call fails, the usage chunk if asked, then [DONE]."""
    choices, head = _choices(call), _head(state, call)
    text = state.token_text

    def sse(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events() -> AsyncIterator[str]:
        generated, failed = 0, None
        try:
            async for job, out in results(state, call):
                for o in out.outputs:
                    generated += 0 if job.echo_only else len(o.token_ids)
                    choice = choices[job.index * call.n + o.index]
                    piece = piece_of(job, out, o)
                    if piece is None or choice.finish_reason is not None:
                        continue
                    if job.echo and not job.echo_only and not choice.started:
                        prompt = job.prompt_logprobs or [None] * len(job.prompt.ids)
                        choice.add(Piece(job.prompt.text or "", list(job.prompt.ids), list(prompt)))
                    choice.add(piece)
                    if piece.text or piece.finish_reason is not None:  # else: wait for text
                        part = choice_json(
                            choice, choice.take(), call.chat, True, call.top_logprobs, text
                        )
                        yield sse({**head, "choices": [part]})
        except ApiError as err:
            failed = err
        if failed is not None:
            for choice in choices.values():
                if choice.finish_reason is None:
                    choice.add(Piece(finish_reason="abort"))
                    part = choice_json(
                        choice, choice.take(), call.chat, True, call.top_logprobs, text
                    )
                    yield sse({**head, "choices": [part]})
            yield sse(error_body(str(failed), failed.param, failed.status))
        elif call.include_usage:
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


def error_json(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(str(err), err.param, err.status), status_code=err.status)
