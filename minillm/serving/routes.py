"""The endpoints, as plain functions over the app's shared state (`request.app.state.server`,
a `ServerState`): OpenAI's /v1/completions, /v1/chat/completions and /v1/models; vLLM's
/tokenize, /detokenize, /tokenizer_info and /version; /health and Prometheus /metrics.

A POST route reads its raw body (already bounded by `BodyLimit`) and hands it to the
thread pool, where it is parsed, checked and tokenized: the event loop only moves bytes
and outputs, so /health answers at once even while a maximal request is being prepared.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from minillm.serving.calls import Call, ServerState, chat_call, completion_call
from minillm.serving.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from minillm.serving.responses import complete, stream
from minillm.serving.validation import chat_prompt, check_model, encode_texts, parse


def server(request: Request) -> ServerState:
    return request.app.state.server


async def answer(request: Request, build: Any) -> Response:
    state = server(request)
    call: Call = await state.run(build, await request.body(), state)
    return stream(state, call) if call.stream else await complete(state, request, call)


async def completions(request: Request) -> Response:
    return await answer(request, completion_call)


async def chat_completions(request: Request) -> Response:
    return await answer(request, chat_call)


def _tokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    body = parse(raw, TokenizeRequest)
    check_model(body.model, state.model_name)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError("give either prompt (text) or messages (a chat), not both or neither")
    tok, ctx, chars = state.tokenizer, state.context, state.token_chars
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = encode_texts([body.prompt], tok, ctx, chars, special)[0]
    else:
        prompt = chat_prompt(
            body.messages, body.add_generation_prompt, tok, state.chat_template, ctx, chars
        )
        ids = prompt.ids
        if body.add_special_tokens:  # as vLLM: around the rendered text too
            ids = encode_texts([prompt.text], tok, ctx, chars, True)[0]
    strs = [state.token_text(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx, "tokens": ids, "token_strs": strs}


def _detokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    body = parse(raw, DetokenizeRequest)
    check_model(body.model, state.model_name)
    vocab = state.engine.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab][:3]
    if bad:
        raise ApiError(f"tokens {bad} are outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}


async def tokenize(request: Request) -> dict[str, Any]:
    return await server(request).run(_tokenize, await request.body(), server(request))


async def detokenize(request: Request) -> dict[str, Any]:
    return await server(request).run(_detokenize, await request.body(), server(request))


async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's /tokenizer_info: what a client needs to tokenize like the server (lm-eval's
    remote tokenizer reads it)."""
    state = server(request)
    tok = state.tokenizer
    return {
        **{name: value for name, value in tok.special_tokens.items() if value is not None},
        "chat_template": state.chat_template or tok.chat_template,
        "model_max_length": state.context,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


async def models(request: Request) -> dict[str, Any]:
    state = server(request)
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "minillm"}
    return {"object": "list", "data": [{**card, "max_model_len": state.context}]}


async def version(_request: Request) -> dict[str, str]:
    from minillm._version import __version__

    return {"version": __version__}


async def health(_request: Request) -> dict[str, str]:
    return {"status": "ok"}


async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(server(request).core.metrics.render())


POSTS = {  # path -> (route, its JSON body: documented in the OpenAPI schema)
    "/v1/completions": (completions, CompletionRequest),
    "/v1/chat/completions": (chat_completions, ChatRequest),
    "/tokenize": (tokenize, TokenizeRequest),
    "/detokenize": (detokenize, DetokenizeRequest),
}
GETS = {
    "/v1/models": models,
    "/tokenizer_info": tokenizer_info,
    "/version": version,
    "/health": health,
    "/metrics": metrics,
}


ERRORS = {
    400: "bad input: the message names the field and the fix",
    404: "a model this server does not serve",
    413: "a body over the size limit",
    500: "the engine failed on this request (it alone was aborted)",
    503: "the server is shutting down",
}


def register(app: FastAPI) -> None:
    """Add the routes; each POST's body schema goes into the OpenAPI document (the routes
    read raw bytes, so FastAPI cannot infer it), with the errors it can answer."""
    errors = {code: {"model": ErrorResponse, "description": why} for code, why in ERRORS.items()}
    ok = {
        "description": "the answer (server-sent events when streamed)",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
    for path, (route, body) in POSTS.items():
        schema = {"$ref": f"#/components/schemas/{body.__name__}"}
        content = {"application/json": {"schema": schema}}
        extra = {"requestBody": {"required": True, "content": content}}
        responses = {200: ok, **errors}
        app.add_api_route(path, route, methods=["POST"], openapi_extra=extra, responses=responses)
    for path, route in GETS.items():
        kind = PlainTextResponse if route is metrics else None  # Prometheus' text format
        app.add_api_route(
            path, route, methods=["GET"], **({"response_class": kind} if kind else {})
        )
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for _route, body in POSTS.values():
                found = body.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(found.pop("$defs", {}))
                schemas[body.__name__] = found
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
