"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

`python -m minillm serve` starts it. Endpoints: POST /v1/completions and
/v1/chat/completions (JSON, or server-sent events with `"stream": true`, ending with
`data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus text format).

The engine is not thread-safe and its `step()` is blocking, so it runs in one background
thread (`AsyncEngine`); HTTP handlers add requests under a lock and receive outputs on an
asyncio queue. A client that disconnects (streaming or not) has its request aborted,
which frees its KV blocks at once. Bad input gets HTTP 400 with OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`) and the server keeps serving.

Chat prompts use the tokenizer config's `chat_template` (Jinja) when it has one. The
bundled model has none (it was trained on plain text), so the documented default is one
line per message, `"{role}: {content}\\n"`, followed by `"assistant:"`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field

from minillm.engine.engine import Engine, RequestOutput
from minillm.engine.sequence import SamplingParams

log = logging.getLogger("minillm.server")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ApiError(Exception):
    """Bad input: becomes HTTP 400 with OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_response(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# ------------------------------------------------------------------ request bodies
class _Common(BaseModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # vLLM's extra sampling parameters (send them with the openai client's extra_body)
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]]


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


# ------------------------------------------------------------------ engine thread
class AsyncEngine:
    """The engine stepping in a background thread. Handlers never touch it directly: they
    post "add" and "abort" commands to an inbox that the engine thread drains between
    steps (no lock to wait for, so the event loop never stalls behind a step), and read
    the state snapshot the engine thread publishes after each step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.running = False
        self.thread: threading.Thread | None = None
        self.rate_window: deque[tuple[float, int]] = deque()  # (time, generated tokens)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.snapshot: dict[str, float] = self._state()

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def add(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Check and queue a request (ValueError if it can never run); its outputs arrive
        on the returned asyncio queue."""
        self.engine.check_request(prompt_ids, params)  # reads only fixed configuration
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(out: RequestOutput) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        request_id = uuid.uuid4().hex
        self.inbox.put(("add", request_id, prompt_ids, params, deliver, time.perf_counter()))
        self.wake.set()
        return request_id, outputs

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))
        self.wake.set()

    def _drain(self) -> None:
        while not self.inbox.empty():
            command, request_id, *args = self.inbox.get()
            if command == "add":
                prompt_ids, params, deliver, arrival = args
                self.engine.add_request(prompt_ids, params, request_id, deliver, arrival)
            else:
                self.engine.abort(request_id)

    def _loop(self) -> None:
        while self.running:
            self.wake.clear()
            try:
                self._drain()
                if not self.engine.has_unfinished():
                    self.snapshot = self._state()
                    self.wake.wait(timeout=1.0)
                    continue
                self.engine.step()
            except Exception:  # a bug, not bad input: fail the requests, keep serving
                log.exception("engine step failed; aborting the running requests")
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
            now = time.perf_counter()
            self.rate_window.append((now, self.engine.num_generated_tokens))
            while now - self.rate_window[0][0] > 10:
                self.rate_window.popleft()
            self.snapshot = self._state()

    def _state(self) -> dict[str, float]:
        """The gauges and counters of /metrics (built on the engine thread)."""
        e = self.engine
        return {
            "num_requests_running": len({s.request_id for s in e.scheduler.running}),
            "num_requests_waiting": len({s.request_id for s in e.scheduler.waiting}),
            "kv_blocks_used": e.num_blocks_used,
            "kv_blocks_total": e.manager.num_blocks,
            "prompt_tokens_total": e.num_prompt_tokens,
            "generation_tokens_total": e.num_generated_tokens,
            "requests_finished_total": e.num_finished,
            "requests_aborted_total": e.num_aborted,
            "preemptions_total": e.scheduler.num_preemptions,
            "generation_tokens_per_second": self._tokens_per_second(),
        }

    def _tokens_per_second(self) -> float:
        """Generated tokens per second over the last 10 s of steps."""
        window = self.rate_window
        if len(window) < 2 or time.perf_counter() - window[-1][0] > 10:
            return 0.0
        (t0, n0), (t1, n1) = window[0], window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts = buckets, [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.sum, self.count = self.sum + value, self.count + 1

    def lines(self, name: str) -> list[str]:
        out = [
            f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}"]
        return out + [f"{name}_count {self.count}"]


# ------------------------------------------------------------------ the app
def default_chat_template(messages: list[dict[str, str]]) -> str:
    """The bundled model's chat format: one "role: content" line each, then "assistant:"."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def load_chat_template(model_dir: str | Path) -> str | None:
    """The Jinja `chat_template` of a checkpoint's tokenizer config, if it has one."""
    path = Path(model_dir) / "tokenizer_config.json"
    return json.loads(path.read_text()).get("chat_template") if path.exists() else None


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

    def make_params(body: _Common, prompt_len: int, max_tokens: int | None) -> SamplingParams:
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

    def usage(out: RequestOutput) -> dict[str, int]:
        done = sum(len(o.token_ids) for o in out.outputs)
        n_prompt = len(out.prompt_token_ids)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": done,
            "total_tokens": n_prompt + done,
        }

    async def respond(
        request: Request,
        body: _Common,
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
            last = None
            stream = results(request_id, outputs)
            async for out in stream:
                last = out
                if not out.finished and await request.is_disconnected():
                    await stream.aclose()  # the client left: abort, free the blocks
                    return JSONResponse({}, status_code=499)
            if chat:
                choices = [
                    {
                        "index": o.index,
                        "message": {"role": "assistant", "content": o.text},
                        "finish_reason": o.finish_reason,
                        "logprobs": None,
                    }
                    for o in last.outputs
                ]
                return {
                    **head,
                    "object": "chat.completion",
                    "choices": choices,
                    "usage": usage(last),
                }
            choices = [
                {
                    "index": o.index,
                    "text": o.text,
                    "finish_reason": o.finish_reason,
                    "logprobs": None,
                }
                for o in last.outputs
            ]
            return {**head, "object": "text_completion", "choices": choices, "usage": usage(last)}

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
            sent = [""] * params.n
            closed = [False] * params.n
            last = None
            async for out in results(request_id, outputs):
                last = out
                for o in out.outputs:
                    if closed[o.index]:
                        continue
                    delta = o.text[len(sent[o.index]) :]
                    if delta or o.finish_reason is not None:
                        first = not sent[o.index]
                        sent[o.index] += delta
                        closed[o.index] = o.finish_reason is not None
                        yield chunk(o.index, delta, o.finish_reason, first)
            if include_usage and last is not None:
                tail = {**head, "object": kind, "choices": [], "usage": usage(last)}
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

    from minillm.weights import load_model, load_tokenizer, resolve_model_dir

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
