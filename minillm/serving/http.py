"""The server's transport, on uvicorn's h11 protocol: the limits uvicorn leaves out, and a
shutdown that answers everyone.

- **Timeouts.** uvicorn closes a connection idle between requests (`idle_timeout`, its
  keep-alive), but it waits forever for the headers of a request, so a client that opens a
  connection and sends nothing, or sends its headers a byte at a time, holds a socket for
  good. `header_timeout` bounds the time from the connection (or the previous response) to
  the end of the headers; `errors.BodyLimit` bounds the body (`body_timeout`, 408).
- **Errors.** A request that is not HTTP gets OpenAI's error JSON, as every other 4xx does,
  not uvicorn's plain text.
- **Shutdown.** On SIGTERM uvicorn stops accepting and lets open requests finish for
  `shutdown_timeout` seconds, then cancels them, and an answer cancelled mid-way is a
  plain-text 500 or a stream cut short. So at the deadline `Server` first gives every
  unfinished request its shutdown error (a JSON 503, or a stream's error event and
  `[DONE]`), and uvicorn's own deadline comes `WRITE_GRACE_S` later, when those are written.
  A watchdog ends the process if even that hangs (a blocked event loop).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from minillm.serving.protocol import error_body

log = logging.getLogger(__name__)
WRITE_GRACE_S = 0.5  # after the shutdown deadline: time to write the 503s and error events
WATCHDOG_GRACE_S = 5.0  # after that: the process ends even if the event loop is blocked


@dataclass(frozen=True)
class Timeouts:
    """Seconds a client may take (`python -m minillm serve --*-timeout`)."""

    idle: float = 5.0  # between two requests on a kept-alive connection (uvicorn's keep-alive)
    header: float = 10.0  # from the connection (or the last response) to the request's headers
    body: float = 30.0  # from the headers to the end of the body
    shutdown: float = 5.0  # SIGTERM: open requests may finish this long, then get a 503

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not v > 0}
        if bad:
            raise ValueError(f"timeouts must be > 0 seconds, got {bad}")


DEFAULT_TIMEOUTS = Timeouts()


def raw_json(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response carrying OpenAI's error JSON, for the connection to close."""
    body = json.dumps(error_body(message, None, status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and JSON protocol errors."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_timer: Any = None
        self.got_bytes = False  # of the next request

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.header_timer is not None:
            self.header_timer.cancel()  # the headers are in: the body has its own limit
            self.header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
        self.got_bytes = False
        self.header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.got_bytes:  # a request was started and not finished: say why it is dropped
            message = f"the request headers did not arrive within {self.header_timeout:g} s"
            self.transport.write(raw_json(408, "Request Timeout", message))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        message = "the request is not valid HTTP/1.1 (its request line or headers are malformed)"
        self.transport.write(raw_json(400, "Bad Request", message))
        self.transport.close()


def config(
    app: Any, host: str, port: int, timeouts: Timeouts = DEFAULT_TIMEOUTS, log_level: str = "info"
) -> uvicorn.Config:
    """uvicorn's config for the server app, with the protocol and timeouts above."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=functools.partial(Protocol, header_timeout=timeouts.header),  # type: ignore[arg-type]
        timeout_keep_alive=timeouts.idle,  # type: ignore[arg-type]
        timeout_graceful_shutdown=timeouts.shutdown + WRITE_GRACE_S,  # type: ignore[arg-type]
    )


class Server(uvicorn.Server):
    """uvicorn's server; once asked to exit, it calls `at_deadline` (which fails what is
    still running) after `shutdown_timeout` seconds, and ends the process if it is still
    alive `WRITE_GRACE_S + WATCHDOG_GRACE_S` after that."""

    def __init__(self, config: uvicorn.Config, at_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self.at_deadline = at_deadline
        self.timers: list[threading.Timer] = []

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            drain = float(self.config.timeout_graceful_shutdown or 0) - WRITE_GRACE_S
            for seconds, then in (
                (drain, self.at_deadline),
                (drain + WRITE_GRACE_S + WATCHDOG_GRACE_S, _hard_exit),
            ):
                self.timers.append(threading.Timer(seconds, then))
                self.timers[-1].daemon = True
                self.timers[-1].start()
        super().handle_exit(sig, frame)

    async def serve(self, sockets: Any = None) -> None:
        try:
            await super().serve(sockets)
        finally:  # shut down in time: the deadline and the watchdog have nothing left to do
            for timer in self.timers:
                timer.cancel()


def _hard_exit() -> None:
    log.error("shutdown did not finish in time: exiting now")
    os._exit(1)
