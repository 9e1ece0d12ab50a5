"""Chapter 09 exercises: serving metrics from the timestamps of one request, and one
rank's share of a tensor-parallel MLP.

Every serving benchmark reduces a streamed request to four timestamps: when it was
sent, when its first token (chunk) arrived, when each later chunk arrived, and when it
ended. Notebook 09's harness (`minillm.bench`) derives vLLM `bench serve`'s metrics from
them; here you write that derivation for one request:

    request_metrics   TTFT, TPOT, ITL and E2E of one request
    parallel_mlp      one rank's share of a SwiGLU MLP split over N ranks, one all-reduce

The tests compare your numbers with the harness's `compute_metrics` on timestamps the
chapter 08 engine records live, on a server's bursty chunks (several tokens per chunk),
and on the edge cases (one token, nothing at all); `parallel_mlp` runs on two and three
gloo ranks (processes) against the unsplit MLP. Grade them with

    make grade CH=09    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch09

The answer is in `solutions/ch09_choosing_a_stack.py`: try first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: F401  (for your answer)


def request_metrics(
    send: float, token_times: list[float], end: float, num_tokens: int
) -> dict[str, float | list[float] | None]:
    """The serving metrics of one streamed request, in seconds.

    Args:
        send: when the request was sent.
        token_times: when each streamed chunk arrived, in order (an HTTP server may put
            several tokens in one chunk; an in-process engine reports one per token).
        end: when the request ended (its last chunk, or the stream's close).
        num_tokens: output tokens the request produced in all (>= len(token_times)).

    Returns:
        {"ttft": first chunk - send, or None when nothing arrived,
         "tpot": (e2e - ttft) / (num_tokens - 1), or None unless num_tokens > 1 and a
                 chunk arrived,
         "itl":  the gaps between consecutive chunks, a list (empty for fewer than two),
         "e2e":  end - send}

    Pitfalls: TPOT divides by output *tokens* minus one, ITL is per *chunk*: for a server
    that sends tokens in bursts the two disagree, which is the point of reporting both.
    TPOT excludes the first token (whose wait is TTFT: queueing and prefill), so it is
    undefined for a one-token request, not zero; averaging a zero in would flatter a
    server. E2E runs to `end`, not to the last chunk.
    """
    raise NotImplementedError("ch09: implement request_metrics")


def parallel_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    rank: int,
    size: int,
    all_reduce: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """Rank `rank`'s share of the SwiGLU MLP down(silu(gate(x)) * up(x)) split Megatron-style
    over `size` ranks, returning the full output on every rank.

    Args:
        x: the input [T, hidden], the same on every rank.
        gate, up: the full weights [inter, hidden] (here every rank is handed them all; a
            real rank loads only its slice).
        down: the full weight [hidden, inter].
        rank, size: which rank this is, of how many (size divides inter).
        all_reduce: `all_reduce(t)` sums t over the ranks, in place (every rank calls it).

    Returns:
        down(silu(gate(x)) * up(x)) [T, hidden].

    The split: rank r owns MLP units [r * inter / size, (r + 1) * inter / size): those rows
    of gate and up (column-parallel: it computes its own units, no communication), and the
    same columns of down (row-parallel: its product is a partial sum of the output). One
    all-reduce adds the partial sums. Pitfalls: the silu and the product are per unit, so
    they are computed on the slice, before any sum; touching a weight outside your slice
    is reading another rank's memory (the test puts NaN there). Use only torch and F here:
    the function runs in processes of its own.
    """
    raise NotImplementedError("ch09: implement parallel_mlp")
