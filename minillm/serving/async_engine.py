"""The engine stepping in a background thread, for the asyncio server, and its metrics."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque

from minillm.engine.llm_engine import Engine
from minillm.engine.outputs import RequestOutput
from minillm.generation.sampling import SamplingParams

log = logging.getLogger(__name__)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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
