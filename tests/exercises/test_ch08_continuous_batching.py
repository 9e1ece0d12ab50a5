"""Chapter 08 exercises, graded on fixed traces and against minillm.engine.

`ch08` is the module under test (solutions/ by default, exercises/ with
MINILLM_IMPL=exercises). Test names start with `test_ch08_<exercise>`.
"""

from __future__ import annotations

import random

import pytest

from minillm import SamplingParams, load_model, load_tokenizer
from minillm.engine import Engine
from minillm.engine.detokenizer import stop_text_holdback

# One urgent stream of short requests and one patient request (priority 5) at step 0.
TRACE = [
    dict(id="A", arrival=0, priority=0, output_len=4),
    dict(id="B", arrival=0, priority=5, output_len=2),
    dict(id="C", arrival=1, priority=0, output_len=3),
    dict(id="D", arrival=2, priority=0, output_len=3),
    dict(id="E", arrival=3, priority=0, output_len=2),
]


# --- admission_order ------------------------------------------------------------------------


def test_ch08_admission_order_strict_priority_and_fcfs_ties(ch08):
    assert ch08.admission_order(TRACE, now=3, aging=0) == ["A", "C", "D", "E", "B"]
    same = [dict(r, priority=1) for r in TRACE]
    assert ch08.admission_order(same, now=3, aging=0) == ["A", "B", "C", "D", "E"]  # FCFS


def test_ch08_admission_order_aging_lifts_the_old_request(ch08):
    waiting = [TRACE[1], TRACE[4]]  # B: priority 5 since step 0; E: priority 0 since 3
    assert ch08.admission_order(waiting, now=4, aging=1) == ["E", "B"]  # 1 vs -1
    assert ch08.admission_order(waiting, now=4, aging=2) == ["B", "E"]  # -3 vs -2
    before = [dict(r) for r in waiting]
    ch08.admission_order(waiting, now=4, aging=2)
    assert waiting == before, "admission_order changed its input"


# --- simulate -------------------------------------------------------------------------------


def test_ch08_simulate_strict_priority_starves_the_patient_request(ch08):
    got = ch08.simulate(TRACE, max_num_seqs=1, aging=0)
    assert got == {"A": (0, 3), "C": (4, 6), "D": (7, 9), "E": (10, 11), "B": (12, 13)}


def test_ch08_simulate_aging_serves_it_earlier(ch08):
    got = ch08.simulate(TRACE, max_num_seqs=1, aging=2)
    assert got == {"A": (0, 3), "C": (4, 6), "D": (7, 9), "B": (10, 11), "E": (12, 13)}


def test_ch08_simulate_finished_requests_free_their_slot_at_once(ch08):
    got = ch08.simulate(TRACE, max_num_seqs=2, aging=0)
    # B finishes at step 1, so C joins at step 2 while A is still running.
    assert got == {"A": (0, 3), "B": (0, 1), "C": (2, 4), "D": (4, 6), "E": (5, 6)}


def test_ch08_simulate_idle_steps_and_late_arrivals(ch08):
    late = [dict(id="X", arrival=5, priority=0, output_len=1)]
    assert ch08.simulate(late, max_num_seqs=4, aging=0) == {"X": (5, 5)}


# --- holdback -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("abc", ["cde"], 1), ("abcd", ["cde"], 2), ("abc", ["xyz"], 0), ("a\n", ["\n\n", "a\nb"], 2)],
)
def test_ch08_holdback_examples(ch08, text, stops, held):
    assert ch08.holdback(text, stops) == held


def test_ch08_holdback_matches_minillm_on_random_text(ch08):
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 6)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in "xy"]
        assert ch08.holdback(text, stops) == stop_text_holdback(text, stops), (text, stops)
    assert ch08.holdback("abc", []) == 0


# --- stream_with_stops ----------------------------------------------------------------------


def test_ch08_stream_with_stops_example(ch08):
    assert ch08.stream_with_stops(["Hel", "lo", " wor", "ld"], ["lo w"]) == (
        ["He", "l", ""],
        "stop",
    )
    assert ch08.stream_with_stops(["a", "b", "c"], ["bd"]) == (["a", "", "bc"], "length")


def test_ch08_stream_with_stops_earliest_stop_wins(ch08):
    chunks, reason = ch08.stream_with_stops(["x", "yz", "w"], ["zw", "y"])
    assert ("".join(chunks), reason) == ("x", "stop")


def test_ch08_stream_with_stops_on_random_streams(ch08):
    rng = random.Random(1)
    for _ in range(300):
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(6)]
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(2, 3)))]
        chunks, reason = ch08.stream_with_stops(pieces, stops)
        text = "".join(pieces)
        cut = text.find(stops[0])
        expected = text if cut < 0 else text[:cut]
        assert "".join(chunks) == expected, (pieces, stops, chunks)
        assert reason == ("length" if cut < 0 else "stop")
        consumed = len(chunks)
        assert consumed == len(pieces) or stops[0] in "".join(pieces[:consumed])
        sent = ""
        for n, chunk in enumerate(chunks[:-1], start=1):  # before the end: exactly the safe text
            sent += chunk
            so_far = "".join(pieces[:n])
            assert sent == so_far[: len(so_far) - stop_text_holdback(so_far, stops)], (pieces, n)


# --- schedule_running -------------------------------------------------------------------------


TEXTS = [
    "In the beginning God created",
    "And the LORD said unto Moses, Speak unto the children of Israel",
    "Blessed are the poor in spirit",
    "And it came to pass after these things",
    "The LORD is my shepherd",
]


def run_engine(model, tok, pass_fn=None, **pool):
    """Greedy outputs of an engine on a tight pool, optionally with `pass_fn` as its
    scheduler's pass over running sequences; and each step's batch, for invariants."""
    engine = Engine(model, tok, **pool)
    if pass_fn is not None:
        engine.scheduler._run_running = lambda batch, budget, prompts: pass_fn(
            engine.scheduler, batch, budget, prompts
        )
    batches, schedule = [], engine.scheduler.schedule

    def recording():
        batch = schedule()
        batches.append(batch)
        return batch

    engine.scheduler.schedule = recording
    for text in TEXTS:
        engine.add_request(text, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    outs = [o.outputs[0].token_ids for o in engine.run_to_completion()]
    return outs, [b for b in batches if b is not None], engine


@pytest.fixture(scope="module")
def bundled():
    return load_model(), load_tokenizer()


POOLS = {
    "recompute": dict(num_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=10),
    "swap": dict(
        num_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=10,
        preemption_mode="swap",
    ),
}  # fmt: skip


@pytest.mark.parametrize("mode", POOLS)
def test_ch08_schedule_running_serves_a_tight_pool_like_the_engine(ch08, bundled, mode):
    model, tok = bundled
    want, _, reference = run_engine(model, tok, **POOLS[mode])
    assert reference.scheduler.num_preemptions > 0, "the pool no longer forces preemption"
    got, batches, engine = run_engine(model, tok, ch08.schedule_running, **POOLS[mode])
    assert engine.scheduler.num_preemptions > 0, "nothing was preempted: make room first"
    for step, batch in enumerate(batches):
        seqs = [item.seq for item in batch.items]
        assert len(seqs) == len(set(seqs)), f"step {step}: a sequence scheduled twice"
        assert not set(seqs) & set(batch.preempted), f"step {step}: preempted and scheduled"
        assert batch.num_tokens <= POOLS[mode]["max_num_batched_tokens"], f"step {step}: budget"
    assert got == want, "other tokens than the engine's own scheduler gives"


def plan(batches) -> list[tuple]:
    """Each step as (who runs how many tokens, who was preempted): the policy itself."""
    return [
        (
            [(i.seq.request_id, i.seq.index, i.num_tokens) for i in b.items],
            [(s.request_id, s.index) for s in b.preempted],
        )
        for b in batches
    ]


def test_ch08_schedule_running_makes_the_engines_choices(ch08, bundled):
    """Oldest served first, newest preempted first: step by step the same plan."""
    model, tok = bundled
    _, want, _ = run_engine(model, tok, **POOLS["recompute"])
    _, got, _ = run_engine(model, tok, ch08.schedule_running, **POOLS["recompute"])
    for step, (a, b) in enumerate(zip(plan(got), plan(want), strict=False)):
        assert a == b, (
            f"step {step}: (runs, preempted) {a}, the engine's scheduler: {b}. Serve the "
            "oldest running sequence first, and preempt the newest one not in this step"
        )
    assert len(got) == len(want)


def test_ch08_schedule_running_leaves_the_pool_whole(ch08, bundled):
    """After the run every block is back: nothing leaked by a preemption."""
    model, tok = bundled
    _, _, engine = run_engine(model, tok, ch08.schedule_running, **POOLS["recompute"])
    manager = engine.manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
