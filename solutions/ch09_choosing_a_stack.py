"""Chapter 09 answers: serving metrics from one request's timestamps, and one rank's share
of a tensor-parallel MLP.

Written from scratch (no minillm), so the tests can compare them with the benchmark
harness's own `minillm.bench.compute_metrics` and with the unsplit MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


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


def parallel_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    rank: int,
    size: int,
    all_reduce: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """Rank `rank`'s share of down(silu(gate(x)) * up(x)), summed over the ranks."""
    n = gate.shape[0] // size
    mine = slice(rank * n, (rank + 1) * n)  # this rank's MLP units
    h = F.silu(x @ gate[mine].T) * (x @ up[mine].T)  # column-parallel: no communication
    out = h @ down[:, mine].T  # row-parallel: a partial sum of the output
    all_reduce(out)  # the one collective: every rank now holds the full sum
    return out
