"""The server's metrics, all in one place: engine gauges and counters (a snapshot the engine
thread publishes after each step, so /metrics never touches the engine), the generation
rate over the last 10 s, and the time-to-first-token histogram; rendered in Prometheus'
text format by `render`."""

from __future__ import annotations

import time
from collections import deque

from minillm.engine.llm_engine import Engine

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATE_WINDOW_S = 10.0


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


class ServerMetrics:
    """What /metrics reports. `update` runs on the engine thread; `observe_ttft` and
    `render` on the event loop (they only read numbers the engine thread replaced whole)."""

    def __init__(self, engine: Engine) -> None:
        self.rate_window: deque[tuple[float, int]] = deque()  # (time, generated tokens)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.num_failed = 0  # requests that failed inside the engine (their error was sent)
        self.snapshot: dict[str, float] = {}
        self.update(engine, stepped=False)

    def update(self, e: Engine, stepped: bool = True) -> None:
        """The gauges and counters of /metrics (built on the engine thread)."""
        now = time.perf_counter()
        if stepped:
            self.rate_window.append((now, e.num_generated_tokens))
            while now - self.rate_window[0][0] > RATE_WINDOW_S:
                self.rate_window.popleft()
        self.snapshot = {
            "num_requests_running": len({s.request_id for s in e.scheduler.running}),
            "num_requests_waiting": len({s.request_id for s in e.scheduler.waiting}),
            "kv_blocks_used": e.num_blocks_used,
            "kv_blocks_total": e.manager.num_blocks,
            "prompt_tokens_total": e.num_prompt_tokens,
            "generation_tokens_total": e.num_generated_tokens,
            "requests_finished_total": e.num_finished,
            "requests_aborted_total": e.num_aborted,
            "requests_failed_total": self.num_failed,
            "preemptions_total": e.scheduler.num_preemptions,
            "generation_tokens_per_second": self._tokens_per_second(now),
        }

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def _tokens_per_second(self, now: float) -> float:
        window = self.rate_window
        if len(window) < 2 or now - window[-1][0] > RATE_WINDOW_S:
            return 0.0
        (t0, n0), (t1, n1) = window[0], window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self) -> str:
        """Prometheus text format: a counter ends in _total, everything else is a gauge."""
        lines = []
        for name, value in self.snapshot.items():
            kind = "counter" if name.endswith("_total") and "blocks" not in name else "gauge"
            lines += [f"# TYPE minillm_{name} {kind}", f"minillm_{name} {value}"]
        lines.append("# TYPE minillm_time_to_first_token_seconds histogram")
        lines += self.ttft.lines("minillm_time_to_first_token_seconds")
        return "\n".join(lines) + "\n"
