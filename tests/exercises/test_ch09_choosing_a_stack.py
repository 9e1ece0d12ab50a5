"""Chapter 09 exercise, graded against the benchmark harness's own metrics.

`ch09` is the module under test (solutions/ by default, exercises/ with
MINILLM_IMPL=exercises). Test names start with `test_ch09_<exercise>`.

The reference is `minillm.bench.compute_metrics`, which turns the harness's `Trace`s into
vLLM bench serve's TTFT / TPOT / ITL / E2E; the timestamps come from the chapter 08 engine
run live on the bundled model (`minillm.bench`'s `minillm` backend).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minillm.bench import Trace, compute_metrics, load_workload, make_backend, percentiles
from minillm.model.weights import load_tokenizer


@pytest.fixture(scope="module")
def recorded() -> list[Trace]:
    """The `tiny` workload served by the chapter 08 engine, 3 requests in flight."""
    backend = make_backend("minillm", None, "cpu", 1)
    backend.load()
    _, requests = load_workload("tiny", load_tokenizer(None))

    class NoBar:
        def update(self, n: int = 1) -> None:
            pass

    return backend.run_all(requests, 3, NoBar())


HINTS = {
    "ttft": "TTFT = first chunk's time - send; None when no token arrived (then left out)",
    "tpot": "TPOT = (end - first chunk's time) / (num_tokens - 1): tokens, not chunks; None "
    "for fewer than 2 tokens",
    "itl": "ITL lists every gap between consecutive chunks' times, len(token_times) - 1 of them",
    "e2e": "E2E = end - send, for every request",
}


def learner(ch09, t: Trace) -> dict:
    out = ch09.request_metrics(t.start, list(t.token_times), t.end, t.num_tokens)
    assert set(out) == {"ttft", "tpot", "itl", "e2e"}, (
        f"request_metrics({t.num_tokens} tokens in {len(t.token_times)} chunks): expected the "
        f"keys ['e2e', 'itl', 'tpot', 'ttft'], got {sorted(map(str, out))}; hint: return a "
        "dict with exactly these four keys"
    )
    return out


def close(a, b) -> bool:
    if a is None or b is None or math.isnan(b):
        return (a is None) and (b is None or math.isnan(b))
    return abs(a - b) < 1e-9


def assert_pooled_equal(ch09, traces: list[Trace]) -> None:
    """The learner's per-request values, pooled like the harness pools them, give the
    harness's mean / p50 / p99 of every metric."""
    mine = [learner(ch09, t) for t in traces]
    pooled = {
        "ttft": [m["ttft"] for m in mine if m["ttft"] is not None],
        "tpot": [m["tpot"] for m in mine if m["tpot"] is not None],
        "itl": [g for m in mine for g in m["itl"]],
        "e2e": [m["e2e"] for m in mine],
    }
    theirs = compute_metrics(traces, duration=1.0)
    for name, values in pooled.items():
        got = {k: 1000 * v for k, v in percentiles(values).items()}
        want = theirs[f"{name}_ms"]
        for stat in ("mean", "p50", "p99"):
            g, w = got[stat], want[stat]
            same = (math.isnan(g) and math.isnan(w)) or abs(g - w) < 1e-6
            assert same, (
                f"request_metrics over {len(traces)} requests, pooled like the harness: {name} "
                f"{stat}: expected the harness's {w:.6f} ms, got {g:.6f} ms; hint: "
                f"{HINTS[name]}"
            )


def test_ch09_request_metrics_worked_example(ch09):
    # notebook 09's request A: sent at 0 s, tokens at 0.1, 0.3, 0.6 s
    m = ch09.request_metrics(0.0, [0.1, 0.3, 0.6], 0.6, 3)
    case = "request_metrics(send 0, chunks at 0.1, 0.3, 0.6 s, end 0.6 s, 3 tokens)"
    assert close(m["ttft"], 0.1), (
        f"{case}: expected TTFT 0.1 s, got {m['ttft']}; hint: first token - send = 0.1 s"
    )
    assert close(m["tpot"], 0.25), (
        f"{case}: expected TPOT 0.25 s, got {m['tpot']}; hint: (0.6 - 0.1) / (3 - 1)"
    )
    assert len(m["itl"]) == 2 and all(map(close, m["itl"], [0.2, 0.3])), (
        f"{case}: expected ITL [0.2, 0.3] s, got {m['itl']}; hint: {HINTS['itl']}"
    )
    assert close(m["e2e"], 0.6), f"{case}: expected E2E 0.6 s, got {m['e2e']}; hint: end - send"


def test_ch09_request_metrics_one_token_has_no_tpot_and_no_itl(ch09):
    m = ch09.request_metrics(1.0, [1.5], 1.5, 1)
    case = "request_metrics(send 1.0, one chunk at 1.5 s, end 1.5 s, 1 token)"
    assert close(m["ttft"], 0.5), f"{case}: expected TTFT 0.5 s, got {m['ttft']}; hint: 1.5 - 1.0"
    assert close(m["e2e"], 0.5), f"{case}: expected E2E 0.5 s, got {m['e2e']}; hint: end - send"
    assert m["tpot"] is None, (
        f"{case}: expected TPOT None, got {m['tpot']}; hint: the TPOT of a one-token request "
        "is undefined: (num_tokens - 1) is 0"
    )
    assert list(m["itl"]) == [], (
        f"{case}: expected ITL [], got {m['itl']}; hint: one chunk has no gap between chunks"
    )
    assert_pooled_equal(ch09, [Trace(1.0, [1.5], 1.5, 1)])


def test_ch09_request_metrics_empty_request(ch09):
    m = ch09.request_metrics(2.0, [], 2.25, 0)
    case = "request_metrics(send 2.0, no chunks, end 2.25 s, 0 tokens)"
    assert m["ttft"] is None, (
        f"{case}: expected TTFT None, got {m['ttft']}; hint: no token arrived, so there is no "
        "first token time (do not index token_times[0])"
    )
    assert m["tpot"] is None, f"{case}: expected TPOT None, got {m['tpot']}; hint: no tokens"
    assert list(m["itl"]) == [], f"{case}: expected ITL [], got {m['itl']}; hint: no chunks"
    assert close(m["e2e"], 0.25), (
        f"{case}: expected E2E 0.25 s, got {m['e2e']}; hint: E2E still runs from send to end"
    )
    assert_pooled_equal(ch09, [Trace(2.0, [], 2.25, 0), Trace(0.0, [0.1, 0.3, 0.6], 0.6, 3)])


def test_ch09_request_metrics_end_after_the_last_chunk(ch09):
    m = ch09.request_metrics(0.0, [0.2, 0.4], 0.5, 2)
    case = "request_metrics(send 0, chunks at 0.2, 0.4 s, end 0.5 s, 2 tokens)"
    assert close(m["e2e"], 0.5), (
        f"{case}: expected E2E 0.5 s, got {m['e2e']}; hint: E2E runs to `end`, not to the "
        "last chunk"
    )
    assert close(m["tpot"], 0.3), (
        f"{case}: expected TPOT 0.3 s, got {m['tpot']}; hint: (end - first chunk) / "
        "(num_tokens - 1) = (0.5 - 0.2) / 1"
    )


def test_ch09_request_metrics_matches_the_harness_on_recorded_engine_traces(ch09, recorded):
    assert len(recorded) == 3 and all(t.num_tokens > 1 for t in recorded)
    for t in recorded:
        one = compute_metrics([t], duration=1.0)
        m = learner(ch09, t)
        case = (
            f"request_metrics(a recorded engine request: {t.num_tokens} tokens in "
            f"{len(t.token_times)} chunks)"
        )
        for name in ("ttft", "tpot", "e2e"):
            assert close(m[name], one[f"{name}_ms"]["mean"] / 1000), (
                f"{case}: expected {name} {one[f'{name}_ms']['mean'] / 1000} s (the "
                f"harness's), got {m[name]}; hint: {HINTS[name]}"
            )
        assert len(m["itl"]) == len(t.token_times) - 1, (
            f"{case}: expected {len(t.token_times) - 1} ITL gaps, got {len(m['itl'])}; "
            "hint: one gap per pair of consecutive chunks"
        )
    assert_pooled_equal(ch09, recorded)


def test_ch09_request_metrics_bursty_chunks_count_tokens_for_tpot(ch09, recorded):
    # A server that streams two tokens per chunk: the same requests, every other stamp.
    bursty = [Trace(t.start, t.token_times[1::2], t.end, t.num_tokens) for t in recorded]
    for t in bursty:
        m = learner(ch09, t)
        expected = (t.end - t.token_times[0]) / (t.num_tokens - 1)
        assert close(m["tpot"], expected), (
            f"request_metrics({t.num_tokens} tokens in {len(t.token_times)} chunks of two "
            f"tokens): expected TPOT {expected} s, got {m['tpot']}; hint: divide by output "
            f"tokens - 1 ({t.num_tokens - 1}), not by chunks - 1 ({len(t.token_times) - 1})"
        )
    assert_pooled_equal(ch09, bursty)


def _mlp_weights(seed: int, hidden: int = 16, inter: int = 48) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, hidden, generator=g)
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
    return x, gate, up, torch.randn(hidden, inter, generator=g) / inter**0.5


def _dense_mlp(x, gate, up, down) -> torch.Tensor:
    return F.silu(x @ gate.T) * (x @ up.T) @ down.T


def _one_rank(rank: int, size: int, fn, seed: int) -> dict:
    """A rank of the test: the weights outside its slice are NaN (reading them shows), its
    all-reduces counted."""
    import torch.distributed as dist

    x, gate, up, down = _mlp_weights(seed)
    n = gate.shape[0] // size
    mine = slice(rank * n, (rank + 1) * n)
    masked = [torch.full_like(w, float("nan")) for w in (gate, up, down)]
    masked[0][mine], masked[1][mine], masked[2][:, mine] = gate[mine], up[mine], down[:, mine]
    shapes = []

    def all_reduce(t: torch.Tensor) -> None:
        shapes.append(tuple(t.shape))
        dist.all_reduce(t)

    out = fn(x, *masked, rank, size, all_reduce)
    return {"out": out, "all_reduces": shapes}


@pytest.mark.parametrize("size", [2, 3])
def test_ch09_parallel_mlp_matches_the_whole_mlp_on_every_rank(ch09, size):
    from minillm.lab.ranks import run_ranks

    x, gate, up, down = _mlp_weights(0)
    alone = ch09.parallel_mlp(x, gate, up, down, 0, 1, lambda t: None)  # one rank: no split
    want = _dense_mlp(x, gate, up, down)
    assert torch.allclose(alone, want, atol=1e-5), (
        "parallel_mlp on one rank (size=1): expected the plain MLP down(silu(gate(x)) * up(x)), "
        f"got values off by {(alone - want).abs().max():.3g}; hint: gate and up are [inter, "
        "hidden] (x @ gate.T), down is [hidden, inter]"
    )
    for rank, got in enumerate(run_ranks(_one_rank, size, ch09.parallel_mlp, 0)):
        out, reduces = got["out"], got["all_reduces"]
        assert not out.isnan().any(), (
            f"rank {rank} of {size}: its output has NaN, so it read weights outside its slice "
            f"(they are NaN here); hint: rows [{rank} * inter / {size}, ({rank} + 1) * inter / "
            f"{size}) of gate and up, the same columns of down"
        )
        assert reduces == [tuple(want.shape)], (
            f"rank {rank} of {size}: expected one all_reduce of the output {tuple(want.shape)}, "
            f"got {len(reduces)} call(s) on {reduces}; hint: the silu and product are per MLP "
            "unit, so nothing is summed before down's partial product"
        )
        assert torch.allclose(out, want, atol=1e-5), (
            f"rank {rank} of {size}: expected the whole MLP's output, got values off by "
            f"{(out - want).abs().max():.3g}; hint: all_reduce sums the ranks' partial products "
            "in place: return the tensor you passed it"
        )
