"""Every error the server answers is OpenAI's error JSON, whatever raised it: bad input
(`ApiError`, 400/404), FastAPI's own checks (422 becomes 400, as in vLLM), unknown routes
(404) and methods (405), a body over the size limit (413), and a bug (500, its traceback
in the server's log and never in the response).

`BodyLimit` reads each request body before the app sees it and answers 413 as soon as the
body passes `max_bytes` (or its Content-Length says it will): a 50 MB body is refused after
reading 2 MB, not parsed. It also bounds the time the body takes (408), and is where a
client that leaves, or a shutdown deadline, ends a request without an error of ours.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minillm.serving.async_engine import SHUTDOWN_ERROR
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
    async def _bug(request: Request, err: Exception) -> Response:
        if isinstance(err, ClientDisconnect):  # nobody to answer, and nothing went wrong
            return Response(status_code=499)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        message = f"internal server error ({type(err).__name__}); the server log has the details"
        return error_response(message, None, 500)


class BodyLimit:
    """ASGI middleware, the app's outermost layer: read the whole body before the app sees
    it, refusing one over `max_bytes` (413) or slower than `timeout` seconds (408); let a
    client that leaves mid-body go (nothing to answer, nothing to log); and answer a request
    that uvicorn cancels at its shutdown deadline with a JSON 503 instead of its text 500."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            body = await self._body(scope, receive, tracked)
            if body is None:
                return
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, tracked)
        except asyncio.CancelledError:
            if started:  # a stream cut at the deadline (they get their error event before it)
                raise
            await _send(send, 503, SHUTDOWN_ERROR)
        except ClientDisconnect:  # the client left while the app read or wrote: not an error
            log.debug("%s %s: the client disconnected", scope["method"], scope["path"])

    async def _body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when it was refused (answered) or its client left."""
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not declared.isdigit():
            await _send(send, 400, "the Content-Length header is not a number")
            return None
        if declared is not None and int(declared) > self.max_bytes:
            await _send(send, 413, self._too_large(int(declared)))
            return None
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left before the end
                        log.debug("%s: the client left before its body ended", scope["path"])
                        return None
                    body += message.get("body", b"")
                    if len(body) > self.max_bytes:
                        await _send(send, 413, self._too_large(len(body), at_least=True))
                        return None
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            message = (
                f"the request body did not arrive within {self.timeout:g} s "
                f"({len(body)} bytes came; start the server with a larger --body-timeout)"
            )
            await _send(send, 408, message)
            return None

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (
            f"the request body is {'over ' if at_least else ''}{size} bytes; this server "
            f"takes at most {self.max_bytes} (start it with a larger --max-request-bytes)"
        )


async def _send(send: Send, status: int, message: str) -> None:
    """An error answered before the app has read the body: the connection closes after it,
    since the rest of the body may still be on its way."""
    body = json.dumps(error_body(message, None, status)).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
