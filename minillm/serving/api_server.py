"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

`python -m minillm serve` starts it. Endpoints: POST /v1/completions and
/v1/chat/completions (JSON, or server-sent events with `"stream": true`, ending with
`data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus text format).

The engine is not thread-safe and its `step()` is blocking, so it runs in one background
thread (`async_engine.AsyncEngine`); HTTP handlers post requests to its inbox and receive
outputs on an asyncio queue. A client that disconnects (streaming or not) has its request
aborted, which frees its KV blocks at once. Bad input gets HTTP 400 with OpenAI's error JSON
(`protocol.py`: request bodies, errors, chat prompts) and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from minillm.engine.llm_engine import Engine
from minillm.engine.outputs import RequestOutput
from minillm.generation.sampling import SamplingParams
from minillm.serving.async_engine import AsyncEngine
from minillm.serving.protocol import (
    ApiError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    RequestFields,
    default_chat_template,
    error_response,
    load_chat_template,
)


# ------------------------------------------------------------------ the app
def create_app(engine: Engine, model_name: str, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the model name `model_name`."""
    core = AsyncEngine(engine)
    tok, context = engine.tokenizer, engine.context

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        core.start()
        yield
        core.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.engine = core

    @app.exception_handler(ApiError)
    async def _bad_input(_request: Request, err: ApiError) -> JSONResponse:
        return error_response(str(err), err.param)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        if first.get("type") == "json_invalid":
            return error_response("the request body is not valid JSON")
        if not where and first.get("type") == "model_attributes_type":
            return error_response(
                "the request body must be a JSON object (send Content-Type: application/json)"
            )
        return error_response(f"{where or 'body'}: {first.get('msg')}", where or None)

    def render_chat(messages: list[ChatMessage]) -> str:
        if not messages:
            raise ApiError("messages is empty: give at least one message", "messages")
        plain = []
        for m in messages:
            content = m.content
            if isinstance(content, list):  # OpenAI content parts: only text is supported
                if any(part.get("type") != "text" for part in content):
                    raise ApiError("only text content parts are supported", "messages")
                content = "".join(part.get("text", "") for part in content)
            plain.append({"role": m.role, "content": content})
        if chat_template is None:
            return default_chat_template(plain)
        import jinja2

        return jinja2.Template(chat_template).render(
            messages=plain, add_generation_prompt=True, bos_token="", eos_token=""
        )

    def make_params(body: RequestFields, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        if body.model not in (None, model_name):
            raise ApiError(
                f"model {body.model!r} is not served here; this server serves {model_name!r}",
                "model",
            )
        if max_tokens is None:
            max_tokens = max(context - prompt_len, 1)
        try:
            return SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_tokens=max_tokens,
                seed=body.seed,
                ignore_eos=body.ignore_eos,
                stop_token_ids=list(body.stop_token_ids),
                n=body.n,
                stop=body.stop,
                output_kind="delta",  # each output carries only what is new: O(1) per token
            )
        except ValueError as err:
            raise ApiError(str(err)) from None

    def start(prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        try:
            return core.add(prompt_ids, params)
        except ValueError as err:  # too long, n too large, pool too small
            raise ApiError(str(err)) from None

    async def results(request_id: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborts it if the consumer goes away
        (client disconnect cancels the task, or a closed generator)."""
        finished = ttft_seen = False
        try:
            while not finished:
                out = await outputs.get()
                if not ttft_seen and out.metrics.first_token_time is not None:
                    ttft_seen = True
                    core.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
                finished = out.finished
                yield out
        finally:
            if not finished:
                core.abort(request_id)

    def usage(out: RequestOutput, done: int) -> dict[str, int]:
        n_prompt = len(out.prompt_token_ids)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": done,
            "total_tokens": n_prompt + done,
        }

    async def respond(
        request: Request,
        body: RequestFields,
        prompt: str | list[int],
        max_tokens: int | None,
        chat: bool,
    ):
        prompt_ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = make_params(body, len(prompt_ids), max_tokens)
        request_id, outputs = start(prompt_ids, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "created": created, "model": model_name}
        if not body.stream:
            last, texts, counts = None, [""] * params.n, [0] * params.n
            reasons: list[str | None] = [None] * params.n
            stream = results(request_id, outputs)
            async for out in stream:
                last = out
                for o in out.outputs:
                    texts[o.index] += o.text
                    counts[o.index] += len(o.token_ids)
                    reasons[o.index] = o.finish_reason
                if not out.finished and await request.is_disconnected():
                    await stream.aclose()  # the client left: abort, free the blocks
                    return JSONResponse({}, status_code=499)
            use = usage(last, sum(counts))
            if chat:
                choices = [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": texts[i]},
                        "finish_reason": reasons[i],
                        "logprobs": None,
                    }
                    for i in range(params.n)
                ]
                return {**head, "object": "chat.completion", "choices": choices, "usage": use}
            choices = [
                {"index": i, "text": texts[i], "finish_reason": reasons[i], "logprobs": None}
                for i in range(params.n)
            ]
            return {**head, "object": "text_completion", "choices": choices, "usage": use}

        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(index: int, text: str, reason: str | None, first: bool) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": None}
            return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"

        async def events() -> AsyncIterator[str]:
            started, closed, generated = [False] * params.n, [False] * params.n, 0
            last = None
            async for out in results(request_id, outputs):
                last = out
                for o in out.outputs:  # deltas: only what is new since the last output
                    generated += len(o.token_ids)
                    if closed[o.index] or not (o.text or o.finish_reason is not None):
                        continue
                    yield chunk(o.index, o.text, o.finish_reason, not started[o.index])
                    started[o.index] = True
                    closed[o.index] = o.finish_reason is not None
            if include_usage and last is not None:
                tail = {**head, "object": kind, "choices": [], "usage": usage(last, generated)}
                yield f"data: {json.dumps(tail)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(
                    "send one prompt per request (a list of one string is fine)", "prompt"
                )
            prompt = prompt[0]
        if not prompt:
            raise ApiError("prompt is empty", "prompt")
        return await respond(request, body, prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        prompt = render_chat(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await respond(request, body, prompt, max_tokens, chat=True)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "minillm"}
        return {"object": "list", "data": [{**card, "max_model_len": context}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        lines = []
        for name, value in core.snapshot.items():
            kind = "counter" if name.endswith("_total") and "blocks" not in name else "gauge"
            lines += [f"# TYPE minillm_{name} {kind}", f"minillm_{name} {value}"]
        lines.append("# TYPE minillm_time_to_first_token_seconds histogram")
        lines += core.ttft.lines("minillm_time_to_first_token_seconds")
        return PlainTextResponse("\n".join(lines) + "\n")

    return app


def build_app(
    model: str | None = None, served_model_name: str | None = None, **engine_kwargs: Any
) -> FastAPI:
    """Load a checkpoint (None: the bundled model) and wrap it in the server app."""
    import torch

    from minillm.model.weights import load_model, load_tokenizer, resolve_model_dir

    device = engine_kwargs.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine(load_model(model, device=device), load_tokenizer(model), **engine_kwargs)
    name = served_model_name or model or "minillm-bundled"
    return create_app(engine, name, load_chat_template(resolve_model_dir(model)))


def serve(
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    **engine_kwargs: Any,
) -> None:
    """Run the OpenAI-compatible server until interrupted (`python -m minillm serve`)."""
    import uvicorn

    app = build_app(model, served_model_name, **engine_kwargs)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
