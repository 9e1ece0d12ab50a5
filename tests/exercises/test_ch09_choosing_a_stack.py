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


def learner(ch09, t: Trace) -> dict:
    out = ch09.request_metrics(t.start, list(t.token_times), t.end, t.num_tokens)
    assert set(out) == {"ttft", "tpot", "itl", "e2e"}, f"keys {sorted(out)}"
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
            assert same, f"{name} {stat}: yours {g:.6f} ms, the harness's {w:.6f} ms"


def test_ch09_request_metrics_worked_example(ch09):
    # notebook 09's request A: sent at 0 s, tokens at 0.1, 0.3, 0.6 s
    m = ch09.request_metrics(0.0, [0.1, 0.3, 0.6], 0.6, 3)
    assert close(m["ttft"], 0.1), f"TTFT {m['ttft']}: first token - send = 0.1 s"
    assert close(m["tpot"], 0.25), f"TPOT {m['tpot']}: (0.6 - 0.1) / (3 - 1) = 0.25 s"
    assert len(m["itl"]) == 2 and all(map(close, m["itl"], [0.2, 0.3])), f"ITL {m['itl']}"
    assert close(m["e2e"], 0.6), f"E2E {m['e2e']}"


def test_ch09_request_metrics_one_token_has_no_tpot_and_no_itl(ch09):
    m = ch09.request_metrics(1.0, [1.5], 1.5, 1)
    assert close(m["ttft"], 0.5) and close(m["e2e"], 0.5), m
    assert m["tpot"] is None, f"TPOT of a one-token request is undefined (None), not {m['tpot']}"
    assert list(m["itl"]) == [], f"one chunk has no gap between chunks: {m['itl']}"
    assert_pooled_equal(ch09, [Trace(1.0, [1.5], 1.5, 1)])


def test_ch09_request_metrics_empty_request(ch09):
    m = ch09.request_metrics(2.0, [], 2.25, 0)
    assert m["ttft"] is None, f"no token arrived: TTFT is None, not {m['ttft']}"
    assert m["tpot"] is None and list(m["itl"]) == [], m
    assert close(m["e2e"], 0.25), f"E2E still runs from send to end: {m['e2e']}"
    assert_pooled_equal(ch09, [Trace(2.0, [], 2.25, 0), Trace(0.0, [0.1, 0.3, 0.6], 0.6, 3)])


def test_ch09_request_metrics_end_after_the_last_chunk(ch09):
    m = ch09.request_metrics(0.0, [0.2, 0.4], 0.5, 2)
    assert close(m["e2e"], 0.5), f"E2E runs to `end` (0.5 s), not the last chunk: {m['e2e']}"
    assert close(m["tpot"], 0.3), f"TPOT (0.5 - 0.2) / 1 = 0.3 s, got {m['tpot']}"


def test_ch09_request_metrics_matches_the_harness_on_recorded_engine_traces(ch09, recorded):
    assert len(recorded) == 3 and all(t.num_tokens > 1 for t in recorded)
    for t in recorded:
        one = compute_metrics([t], duration=1.0)
        m = learner(ch09, t)
        for name in ("ttft", "tpot", "e2e"):
            assert close(m[name], one[f"{name}_ms"]["mean"] / 1000), (
                f"{name}: yours {m[name]}, the harness's {one[f'{name}_ms']['mean'] / 1000}"
            )
        assert len(m["itl"]) == len(t.token_times) - 1, "one gap per pair of chunks"
    assert_pooled_equal(ch09, recorded)


def test_ch09_request_metrics_bursty_chunks_count_tokens_for_tpot(ch09, recorded):
    # A server that streams two tokens per chunk: the same requests, every other stamp.
    bursty = [Trace(t.start, t.token_times[1::2], t.end, t.num_tokens) for t in recorded]
    for t in bursty:
        m = learner(ch09, t)
        expected = (t.end - t.token_times[0]) / (t.num_tokens - 1)
        assert close(m["tpot"], expected), (
            f"TPOT {m['tpot']} != {expected}: divide by output tokens - 1 "
            f"({t.num_tokens - 1}), not by chunks - 1 ({len(t.token_times) - 1})"
        )
    assert_pooled_equal(ch09, bursty)
