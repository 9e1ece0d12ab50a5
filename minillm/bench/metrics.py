"""vLLM `bench serve`'s serving metrics from per-request timestamps, and peak memory."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Trace:
    """What one request did: send time, token (chunk) arrival times, end, the output."""

    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    num_tokens: int = 0
    tokens: list[int] | None = None
    text: str | None = None


def percentiles(xs: list[float]) -> dict[str, float]:
    """mean, p50, p99 of `xs`, as vLLM bench serve computes them (NaN when empty)."""
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    a = np.asarray(xs, dtype=float)
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
    }


def compute_metrics(traces: list[Trace], duration: float) -> dict[str, Any]:
    """TTFT, TPOT, ITL, E2E (ms: mean/p50/p99) and throughputs of a run lasting `duration` s."""
    ttft, tpot, itl, e2e = [], [], [], []
    for t in traces:
        if t.token_times:
            ttft.append(t.token_times[0] - t.start)
            itl += [b - a for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
        e2e.append(t.end - t.start)
        if t.num_tokens > 1 and t.token_times:
            tpot.append((t.end - t.start - ttft[-1]) / (t.num_tokens - 1))
    ms = lambda xs: {k: 1000 * v for k, v in percentiles(xs).items()}  # noqa: E731
    out_tokens = sum(t.num_tokens for t in traces)
    return {
        "requests": len(traces),
        "output_tokens": out_tokens,
        "duration_s": duration,
        "req_s": len(traces) / duration,
        "output_tok_s": out_tokens / duration,
        **{f"{k}_ms": ms(v) for k, v in dict(ttft=ttft, tpot=tpot, itl=itl, e2e=e2e).items()},
    }


class PeakMemory:
    """Peak RSS of this process (sampled every 5 ms) and peak CUDA memory while in use."""

    def __enter__(self) -> PeakMemory:
        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()
        self.start_rss = self.peak_rss = self._proc.memory_info().rss
        self.peak_cuda: int | None = None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)
        if torch.cuda.is_available():
            self.peak_cuda = torch.cuda.max_memory_allocated()
