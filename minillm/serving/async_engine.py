"""The engine stepping in a background thread, for the asyncio server.

Handlers never touch the engine: they post "add" and "abort" commands to an inbox that the
engine thread drains between steps (no lock to wait for, so the event loop never stalls
behind a step). The engine thread hands the outputs each step returns to the `deliver`
callback each handler gave. Every request that was added gets a final output, whatever
happens: its own, an error output if the engine refused it or failed on it, or a shutdown
error when the server stops. So no handler can wait forever on a request nobody will finish.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from minillm.engine.llm_engine import Engine
from minillm.engine.outputs import RequestMetrics, RequestOutput
from minillm.generation.sampling import SamplingParams
from minillm.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)
SHUTDOWN_ERROR = "the server is shutting down: this request was not finished"
Deliver = Callable[[RequestOutput], None]


def failed_output(request_id: str, prompt_ids: list[int], error: str) -> RequestOutput:
    """A final output for a request the engine could not run (no samples, `error` set)."""
    return RequestOutput(
        request_id, None, prompt_ids, [], True, RequestMetrics(time.perf_counter()), error=error
    )


class AsyncEngine:
    """The engine on its own thread; `add` and `abort` are safe from any thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.running = False
        self.thread: threading.Thread | None = None
        self.metrics = ServerMetrics(engine)
        self.pending: dict[str, tuple[list[int], Deliver]] = {}  # added, not yet finished
        self.lock = threading.Lock()

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Give every unfinished request its shutdown error at once, then stop stepping (a
        step in progress ends first, up to `timeout`). Safe to call twice, from any thread;
        a request added after it fails at once."""
        self.running = False
        self.wake.set()
        self._fail_pending(SHUTDOWN_ERROR)
        if self.thread is not None:
            self.thread.join(timeout=timeout)
        self._fail_pending(SHUTDOWN_ERROR)  # what the last step's drain still added

    def _fail_pending(self, error: str) -> None:
        with self.lock:
            left, self.pending = self.pending, {}
        for request_id, (prompt_ids, deliver) in left.items():
            try:
                deliver(failed_output(request_id, prompt_ids, error))
            except Exception:  # the consumer is gone (its event loop closed): nothing to tell
                log.debug("could not deliver the final output of %s", request_id)

    def add(self, prompt_ids: list[int], params: SamplingParams, deliver: Deliver) -> str:
        """Queue a checked request; `deliver(output)` is called on the engine thread with
        each of its outputs, the last one finished."""
        request_id = uuid.uuid4().hex
        if not self.running:  # stopped (or never started): nobody would ever step it
            deliver(failed_output(request_id, prompt_ids, SHUTDOWN_ERROR))
            return request_id
        with self.lock:
            self.pending[request_id] = (prompt_ids, deliver)
        self.inbox.put(("add", request_id, prompt_ids, params, time.perf_counter()))
        self.wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))
        self.wake.set()

    def _route(self, out: RequestOutput | None) -> None:
        """Hand an output the engine returned to its consumer (on the engine thread). A
        consumer that raises is gone: its request is aborted, nobody else's."""
        if out is None:
            return
        with self.lock:
            entry = (self.pending.pop if out.finished else self.pending.get)(out.request_id, None)
        if out.finished and out.error is not None:
            self.metrics.num_failed += 1
        if entry is None:
            return
        try:
            entry[1](out)
        except Exception:  # the consumer's failure, kept to its request
            log.exception("delivering request %s failed; dropping it", out.request_id)
            with self.lock:
                self.pending.pop(out.request_id, None)
            self.engine.abort(out.request_id)

    def _drain(self) -> None:
        while not self.inbox.empty():
            command, request_id, *args = self.inbox.get()
            if command == "abort":
                self._route(self.engine.abort(request_id))
                continue
            prompt_ids, params, arrival = args
            try:
                self.engine.add_request(prompt_ids, params, request_id, arrival)
            except Exception as err:  # refused after all: tell this request only
                log.warning("request %s refused by the engine: %s", request_id, err)
                self._route(failed_output(request_id, prompt_ids, f"{type(err).__name__}: {err}"))

    def _loop(self) -> None:
        try:
            while self.running:
                self.wake.clear()
                try:
                    self._drain()
                    if not self.engine.has_unfinished():
                        self.metrics.update(self.engine, stepped=False)
                        self.wake.wait(timeout=1.0)
                        continue
                    for out in self.engine.step():
                        self._route(out)
                except Exception as err:  # a bug in the shared step itself: nobody's fault
                    log.exception("engine step failed; aborting the requests in flight")
                    for request_id in list(self.engine.requests):
                        self._route(
                            self.engine.abort(request_id, f"internal engine error ({err!r})")
                        )
                self.metrics.update(self.engine)
        finally:  # stopped, or died: no request may wait for a thread that is gone
            self._fail_pending(SHUTDOWN_ERROR if not self.running else "the engine thread died")
