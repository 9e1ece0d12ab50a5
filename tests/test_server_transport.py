"""The server's transport, on raw loopback sockets, every wait bounded:

- a client that leaves mid-body is not an error: nothing is logged, /health stays fast;
- a connection that never sends is closed, headers or a body that come too slowly get a
  JSON 408, a kept-alive connection left idle is closed;
- a request that is not HTTP gets OpenAI's error JSON (uvicorn answers plain text);
- at the shutdown deadline a plain request gets a JSON 503, a stream ends with an "abort"
  finish, an error event and [DONE], and a request whose body is still arriving gets a JSON
  503 too; the watchdog is disarmed once the server has stopped;
- text content parts are joined with newlines, as vLLM joins them.
"""

import json
import logging
import signal
import socket
import threading
import time

import httpx
import pytest
from serving import CHATML, running

from minillm import load_tokenizer
from minillm.engine import Engine
from minillm.serving.api_server import create_app
from minillm.serving.http import Timeouts

C = "/v1/completions"
HALF_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Content-Length: 1000\r\n\r\n{"prompt": '
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket's
    timeout: a server that never closes fails the test with socket.timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)["error"]


def test_a_client_leaving_mid_body_is_not_an_error(model, tok, caplog):
    """200 clients each send half a body and hang up: no log line above INFO (each used to
    cost two tracebacks through the 500 handler), and /health answers fast meanwhile."""
    with caplog.at_level(logging.INFO), running(create_app(Engine(model, tok), "b")) as url:
        latencies = []
        for i in range(200):
            sock = connect(url)
            sock.sendall(HALF_BODY)
            sock.close()
            if i % 20 == 0:
                start = time.perf_counter()
                assert httpx.get(url + "/health", timeout=5).status_code == 200
                latencies.append(time.perf_counter() - start)
        time.sleep(0.3)  # let the server notice the last ones
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    loud = [r for r in caplog.records if r.levelno > logging.INFO]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]
    assert max(latencies) < 0.5, latencies


def test_slow_or_silent_clients_are_cut_off(model, tok):
    timeouts = Timeouts(idle=0.5, header=0.5, body=0.5)
    with running(create_app(Engine(model, tok), "b", timeouts=timeouts), timeouts) as url:
        silent = connect(url)  # sends nothing at all: closed without a word
        started = time.monotonic()
        assert read_all(silent) == b""
        assert time.monotonic() - started < 3

        slow_headers = connect(url)
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        status, error = error_of(read_all(slow_headers))
        assert status == 408 and "headers did not arrive within 0.5 s" in error["message"]

        slow_body = connect(url)
        slow_body.sendall(HALF_BODY)
        status, error = error_of(read_all(slow_body))
        assert status == 408 and "body did not arrive within 0.5 s" in error["message"]
        assert "--body-timeout" in error["message"] and error["code"] == 408

        idle = connect(url)  # one request, then nothing: uvicorn's keep-alive closes it
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = read_all(idle)
        assert response.startswith(b"HTTP/1.1 200") and response.endswith(b'{"status":"ok"}')


def test_a_request_that_is_not_http_gets_openai_json(model, tok):
    with running(create_app(Engine(model, tok), "b")) as url:
        sock = connect(url)
        sock.sendall(b"HELLO THERE\r\n\r\n")
        status, error = error_of(read_all(sock))
        assert status == 400 and "not valid HTTP/1.1" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}


def test_the_shutdown_deadline_answers_every_open_request(model, tok):
    """SIGTERM with a plain request, a stream and a half-sent body open, all slower than the
    1 s drain: each gets a real answer at the deadline, not uvicorn's text 500 or a cut."""
    engine = Engine(model, tok)
    step = engine.step

    def slow_step():  # 200 tokens take 10 s: past the deadline
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    body = {"prompt": "In the", "max_tokens": 200, "ignore_eos": True}
    got: dict = {}
    servers: list = []

    def plain(url):
        got["plain"] = httpx.post(url + C, json=body, timeout=30)

    def streamed(url):
        with httpx.stream("POST", url + C, json={**body, "stream": True}, timeout=30) as r:
            got["stream"] = [line for line in r.iter_lines() if line]

    with running(create_app(engine, "b"), Timeouts(shutdown=1.0), servers) as url:
        half = connect(url)
        half.sendall(HALF_BODY)
        clients = [threading.Thread(target=f, args=(url,)) for f in (plain, streamed)]
        for t in clients:
            t.start()
        time.sleep(0.5)
        servers[0].handle_exit(signal.SIGTERM, None)
        for t in clients:
            t.join(timeout=20)
        status, error = error_of(read_all(half))
    assert status == 503 and "shutting down" in error["message"], error
    assert got["plain"].status_code == 503, got["plain"].text
    assert "shutting down" in got["plain"].json()["error"]["message"]
    events = got["stream"]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 503
    assert json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert len(events) > 4  # it was streaming before the deadline
    for timer in servers[0].timers:  # cancelled when the server stopped: they end at once
        timer.join(timeout=2)
        assert not timer.is_alive(), "the watchdog is still armed"


def test_text_content_parts_are_joined_with_newlines(model, tok):
    with running(create_app(Engine(model, tok), "b", CHATML)) as url:
        parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]

        def ids(content):
            messages = [{"role": "user", "content": content}]
            return httpx.post(url + "/tokenize", json={"messages": messages}, timeout=10).json()

        assert ids(parts)["tokens"] == ids("first\nsecond")["tokens"]
