"""Helpers for the server tests: a free loopback port, an app served on a thread."""

import threading
import time
from contextlib import contextmanager

from minillm.bench.http_load import free_port
from minillm.serving.api_server import http_server
from minillm.serving.http import DEFAULT_TIMEOUTS, Timeouts

# A ChatML template, for chat on the bundled model (which has no template of its own).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@contextmanager
def running(app, timeouts: Timeouts = DEFAULT_TIMEOUTS, server: list | None = None):
    """Serve `app` on a free loopback port in a thread, as `python -m minillm serve` does
    (its transport and timeouts); yields the base url (and appends the uvicorn server to
    `server`, for a test that shuts it down itself)."""
    port = free_port()
    srv = http_server(app, "127.0.0.1", port, timeouts, log_level="error")
    if server is not None:
        server.append(srv)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
