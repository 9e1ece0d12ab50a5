"""Chapter 09 answers: serving metrics from one request's timestamps.

Written from scratch (no minillm), so the tests can compare it with the benchmark
harness's own `minillm.bench.compute_metrics`.
"""

from __future__ import annotations


def request_metrics(
    send: float, token_times: list[float], end: float, num_tokens: int
) -> dict[str, float | list[float] | None]:
    """TTFT, TPOT, ITL and E2E (seconds) of one streamed request, as vLLM bench serve."""
    ttft = token_times[0] - send if token_times else None  # nothing arrived: no first token
    e2e = end - send
    # TPOT counts tokens, not chunks: a chunk may carry several tokens.
    tpot = (e2e - ttft) / (num_tokens - 1) if ttft is not None and num_tokens > 1 else None
    itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]  # gaps between chunks
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}
