"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

`python -m minillm serve` starts it. Endpoints (`routes.py`): POST /v1/completions and
/v1/chat/completions (JSON, or server-sent events with `"stream": true`), vLLM's /tokenize
and /detokenize; GET /v1/models, /tokenizer_info, /version, /health, /metrics.

How it holds up under real clients:

- the engine is not thread-safe and its `step()` blocks, so it runs on its own thread
  (`async_engine.py`); handlers post requests and read outputs from a queue;
- nothing slow runs on the event loop: bodies are size-limited (`BodyLimit`, 413) and then
  parsed, checked, tokenized and formatted in a thread pool (`calls.py`, `validation.py`);
- every input is checked before the engine sees it, and a request that still fails inside
  a step is aborted alone (`engine/model_runner.py`), with an error in its response;
- every error is OpenAI's error JSON (`errors.py`); a client that disconnects has its
  request aborted, which frees its KV blocks at once;
- slow clients are bounded (idle, header and body timeouts), and SIGTERM drains for at most
  the shutdown timeout, then answers what is left with a 503 (`http.py`); a watchdog ends
  the process if even that hangs.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from minillm._version import __version__
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import Engine
from minillm.serving.calls import MAX_BODY_BYTES, MAX_PROMPTS, ServerState
from minillm.serving.errors import BodyLimit, install_error_handlers
from minillm.serving.http import DEFAULT_TIMEOUTS, Server, Timeouts, config
from minillm.serving.routes import register


def create_app(
    engine: Engine,
    model_name: str,
    chat_template: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_prompts: int = MAX_PROMPTS,
    timeouts: Timeouts = DEFAULT_TIMEOUTS,
) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model_name`. Chat renders the
    model's own template (`chat_template` replaces it; without either, chat is a 400)."""
    state = ServerState(engine, model_name, chat_template, max_body_bytes, max_prompts)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.core.start()
        yield
        state.core.stop(timeout=2.0)  # a step takes ms: one still running after 2 s is stuck
        # (the engine thread is a daemon: it cannot hold the process); every unfinished
        # request gets its shutdown error
        engine.close()  # the tensor-parallel ranks, if any
        state.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minillm", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=timeouts.body)
    register(app)
    return app


def build_app(
    model: str | None = None,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    timeouts: Timeouts = DEFAULT_TIMEOUTS,
    device: str | None = None,
    config: EngineConfig | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> FastAPI:
    """Load a checkpoint (None: the bundled model) on `device` (None: cuda if present) and
    wrap an engine with `config` in the server app, its model split over
    `tensor_parallel_size` or `pipeline_parallel_size` ranks. `chat_template`: a Jinja
    file (or the template itself) used instead of the model's."""
    import torch

    from minillm.engine.llm import build_engine
    from minillm.model.weights import load_tokenizer

    tokenizer, config = load_tokenizer(model), config or EngineConfig()
    engine = build_engine(
        model, torch.float32, device or "auto", tokenizer, config,
        tensor_parallel_size, pipeline_parallel_size,
    )  # fmt: skip
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    name = served_model_name or model or "minillm-bundled"
    return create_app(engine, name, chat_template, max_body_bytes, timeouts=timeouts)


def serve(
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    timeouts: Timeouts = DEFAULT_TIMEOUTS,
    **app_kwargs: Any,
) -> None:
    """Run the OpenAI-compatible server until SIGINT/SIGTERM (`python -m minillm serve`)."""
    app = build_app(model, served_model_name, timeouts=timeouts, **app_kwargs)
    http_server(app, host, port, timeouts, log_level).run()


def http_server(
    app: FastAPI,
    host: str,
    port: int,
    timeouts: Timeouts = DEFAULT_TIMEOUTS,
    log_level: str = "info",
) -> Server:
    """uvicorn serving `app` (from `create_app`) with the transport of `http.py`; at the
    shutdown deadline the engine's unfinished requests get their 503."""
    core = app.state.server.core
    return Server(config(app, host, port, timeouts, log_level), lambda: core.stop(timeout=0))
