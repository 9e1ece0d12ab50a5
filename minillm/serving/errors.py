"""Every error the server answers is OpenAI's error JSON, whatever raised it: bad input
(`ApiError`, 400/404), FastAPI's own checks (422 becomes 400, as in vLLM), unknown routes
(404) and methods (405), a body over the size limit (413), and a bug (500, its traceback
in the server's log and never in the response).

`BodyLimit` reads each request body before the app sees it and answers 413 as soon as the
body passes `max_bytes` (or its Content-Length says it will): a 50 MB body is refused after
reading 2 MB, not parsed.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minillm.serving.protocol import ApiError, error_body, error_response

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError) -> JSONResponse:
        return error_response(str(err), err.param, err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        return error_response(f"{where}: {first.get('msg')}", where or None)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 404:
            message = f"no route {request.url.path}: see /docs for this server's endpoints"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        return error_response(message, None, err.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        message = f"internal server error ({type(err).__name__}); the server log has the details"
        return error_response(message, None, 500)


class BodyLimit:
    """ASGI middleware: refuse a request body over `max_bytes` with 413, before parsing."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not declared.isdigit():
            return await _send(send, 400, "the Content-Length header is not a number")
        if declared is not None and int(declared) > self.max_bytes:
            return await _send(send, 413, self._too_large(int(declared)))
        body, first = bytearray(), None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                first = message
                break
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await _send(send, 413, self._too_large(len(body), at_least=True))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first or {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (
            f"the request body is {'over ' if at_least else ''}{size} bytes; this server "
            f"takes at most {self.max_bytes} (start it with a larger --max-request-bytes)"
        )


async def _send(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(message, None, status)).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
