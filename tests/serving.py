"""Helpers for the server tests: a free loopback port, an app served on a thread."""

import threading
import time
from contextlib import contextmanager

import uvicorn

from minillm.bench.http_load import free_port

# A ChatML template, for chat on the bundled model (which has no template of its own).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@contextmanager
def running(app):
    """Serve `app` on a free loopback port in a thread; yields the base url."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
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
