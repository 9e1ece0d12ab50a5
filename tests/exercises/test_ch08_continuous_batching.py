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


ORDER_HINT = (
    "sort by the key (priority - aging * (now - arrival), arrival, id), smallest first: a "
    "lower priority number is more urgent"
)


def test_ch08_admission_order_strict_priority_and_fcfs_ties(ch08):
    got = ch08.admission_order(TRACE, now=3, aging=0)
    want = ["A", "C", "D", "E", "B"]
    assert got == want, (
        f"admission_order(TRACE, now=3, aging=0): expected {want} (B has priority 5), got "
        f"{got}; hint: {ORDER_HINT}"
    )
    same = [dict(r, priority=1) for r in TRACE]
    got = ch08.admission_order(same, now=3, aging=0)
    want = ["A", "B", "C", "D", "E"]
    assert got == want, (  # FCFS
        f"admission_order(TRACE with every priority 1, now=3, aging=0): expected first come, "
        f"first served, {want}, got {got}; hint: ties go to the earlier arrival, then the id"
    )


def test_ch08_admission_order_aging_lifts_the_old_request(ch08):
    waiting = [TRACE[1], TRACE[4]]  # B: priority 5 since step 0; E: priority 0 since 3
    case = "admission_order([B: priority 5, arrival 0; E: priority 0, arrival 3], now=4"
    got = ch08.admission_order(waiting, now=4, aging=1)
    assert got == ["E", "B"], (  # 1 vs -1
        f"{case}, aging=1): expected ['E', 'B'] (effective priorities 1 for B, -1 for E), "
        f"got {got}; hint: {ORDER_HINT}"
    )
    got = ch08.admission_order(waiting, now=4, aging=2)
    assert got == ["B", "E"], (  # -3 vs -2
        f"{case}, aging=2): expected ['B', 'E'] (effective priorities -3 for B, -2 for E), "
        f"got {got}; hint: {ORDER_HINT}"
    )
    before = [dict(r) for r in waiting]
    ch08.admission_order(waiting, now=4, aging=2)
    assert waiting == before, (
        f"{case}, aging=2) changed its input: expected {before}, got {waiting}; hint: sort a "
        "copy (sorted(...)); do not sort, pop from or edit `waiting`"
    )


# --- simulate -------------------------------------------------------------------------------


def test_ch08_simulate_strict_priority_starves_the_patient_request(ch08):
    got = ch08.simulate(TRACE, max_num_seqs=1, aging=0)
    want = {"A": (0, 3), "C": (4, 6), "D": (7, 9), "E": (10, 11), "B": (12, 13)}
    assert got == want, (
        f"simulate(TRACE, max_num_seqs=1, aging=0): expected {{id: (first, last step)}} "
        f"{want}, got {got}; hint: at each step admit in admission_order while a slot is "
        "free; a request makes its first token at the step it is admitted"
    )


def test_ch08_simulate_aging_serves_it_earlier(ch08):
    got = ch08.simulate(TRACE, max_num_seqs=1, aging=2)
    want = {"A": (0, 3), "C": (4, 6), "D": (7, 9), "B": (10, 11), "E": (12, 13)}
    assert got == want, (
        f"simulate(TRACE, max_num_seqs=1, aging=2): expected {want}, got {got}; hint: call "
        "admission_order with the aging and now = the current step, at every step"
    )


def test_ch08_simulate_finished_requests_free_their_slot_at_once(ch08):
    got = ch08.simulate(TRACE, max_num_seqs=2, aging=0)
    # B finishes at step 1, so C joins at step 2 while A is still running.
    want = {"A": (0, 3), "B": (0, 1), "C": (2, 4), "D": (4, 6), "E": (5, 6)}
    assert got == want, (
        f"simulate(TRACE, max_num_seqs=2, aging=0): expected {want}, got {got}; hint: a "
        "request that finishes at step t frees its slot for step t + 1, while the others "
        "run on (count the running ones against max_num_seqs)"
    )


def test_ch08_simulate_idle_steps_and_late_arrivals(ch08):
    late = [dict(id="X", arrival=5, priority=0, output_len=1)]
    got = ch08.simulate(late, max_num_seqs=4, aging=0)
    assert got == {"X": (5, 5)}, (
        f"simulate([X arriving at step 5, 1 token], max_num_seqs=4, aging=0): expected "
        f"{{'X': (5, 5)}}, got {got}; hint: steps with nothing to run still count: loop "
        "until nothing is pending, waiting or running"
    )


# --- holdback -------------------------------------------------------------------------------

HOLD_HINT = (
    "hint: the longest suffix of text that is a proper prefix (shorter than the whole stop) "
    "of some stop string, the longest over all stops"
)


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("abc", ["cde"], 1), ("abcd", ["cde"], 2), ("abc", ["xyz"], 0), ("a\n", ["\n\n", "a\nb"], 2)],
)
def test_ch08_holdback_examples(ch08, text, stops, held):
    got = ch08.holdback(text, stops)
    assert got == held, f"holdback({text!r}, {stops!r}): expected {held}, got {got}; {HOLD_HINT}"


def test_ch08_holdback_matches_minillm_on_random_text(ch08):
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 6)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in "xy"]
        got, want = ch08.holdback(text, stops), stop_text_holdback(text, stops)
        assert got == want, (
            f"holdback({text!r}, {stops!r}): expected {want} (minillm's stop_text_holdback), "
            f"got {got}; {HOLD_HINT}"
        )
    got = ch08.holdback("abc", [])
    assert got == 0, f"holdback('abc', []): expected 0 (no stop strings), got {got}; {HOLD_HINT}"


# --- stream_with_stops ----------------------------------------------------------------------


def test_ch08_stream_with_stops_example(ch08):
    got = ch08.stream_with_stops(["Hel", "lo", " wor", "ld"], ["lo w"])
    assert got == (["He", "l", ""], "stop"), (
        f"stream_with_stops(['Hel', 'lo', ' wor', 'ld'], ['lo w']): expected (['He', 'l', ''], "
        f"'stop'), got {got!r}; hint: after each piece send the newly safe text (holdback "
        "kept back); once a stop appears, send the text before it and end with 'stop'"
    )
    got = ch08.stream_with_stops(["a", "b", "c"], ["bd"])
    assert got == (["a", "", "bc"], "length"), (
        f"stream_with_stops(['a', 'b', 'c'], ['bd']): expected (['a', '', 'bc'], 'length'), "
        f"got {got!r}; hint: when the pieces run out, the last chunk also flushes the text "
        "held back, and the reason is 'length'"
    )


def test_ch08_stream_with_stops_earliest_stop_wins(ch08):
    chunks, reason = ch08.stream_with_stops(["x", "yz", "w"], ["zw", "y"])
    assert ("".join(chunks), reason) == ("x", "stop"), (
        f"stream_with_stops(['x', 'yz', 'w'], ['zw', 'y']): expected the text 'x' and reason "
        f"'stop', got chunks {chunks!r} and {reason!r}; hint: check every stop string and cut "
        "at the earliest position in the text (here 'y', listed second)"
    )


def test_ch08_stream_with_stops_on_random_streams(ch08):
    rng = random.Random(1)
    for _ in range(300):
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(6)]
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(2, 3)))]
        chunks, reason = ch08.stream_with_stops(pieces, stops)
        text = "".join(pieces)
        cut = text.find(stops[0])
        expected = text if cut < 0 else text[:cut]
        case = f"stream_with_stops({pieces}, {stops})"
        assert "".join(chunks) == expected, (
            f"{case}: expected the chunks to join to {expected!r} (the text cut before the "
            f"first stop), got {''.join(chunks)!r} from chunks {chunks}; hint: never send a "
            "character twice, nor one of a stop string"
        )
        want = "length" if cut < 0 else "stop"
        assert reason == ("length" if cut < 0 else "stop"), (
            f"{case}: expected reason {want!r}, got {reason!r}; hint: 'stop' when a stop string "
            "appeared, 'length' when the pieces ran out first"
        )
        consumed = len(chunks)
        assert consumed == len(pieces) or stops[0] in "".join(pieces[:consumed]), (
            f"{case}: expected one chunk per piece consumed, up to the piece that completes "
            f"the stop, got {consumed} chunks; hint: append one chunk (maybe '') per piece "
            "and end the stream at the piece where a stop string first appears"
        )
        sent = ""
        for n, chunk in enumerate(chunks[:-1], start=1):  # before the end: exactly the safe text
            sent += chunk
            so_far = "".join(pieces[:n])
            safe = so_far[: len(so_far) - stop_text_holdback(so_far, stops)]
            assert sent == safe, (
                f"{case}: after piece {n}, expected {safe!r} sent (the text so far minus "
                f"holdback), got {sent!r}; hint: each chunk is the newly safe text: the text "
                "so far, minus what holdback keeps, minus what was already sent"
            )


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

    def recording(*args):
        batch = schedule(*args)
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
    case = f"an engine with your schedule_running on a tight pool ({mode} preemption)"
    assert engine.scheduler.num_preemptions > 0, (
        f"{case}: expected preemptions (the engine's own pass makes "
        f"{reference.scheduler.num_preemptions}), got 0; hint: nothing was preempted: make "
        "room first: while manager.can_append(seq) is False, preempt the newest sequence "
        "not busy in this step"
    )
    budget = POOLS[mode]["max_num_batched_tokens"]
    for step, batch in enumerate(batches):
        seqs = [item.seq for item in batch.items]
        assert len(seqs) == len(set(seqs)), (
            f"{case}, step {step}: expected each sequence scheduled once, got "
            f"{[(s.request_id, s.index) for s in seqs]}; hint: skip what batch.busy() holds "
            "and take each sequence from your queue once"
        )
        both = [(s.request_id, s.index) for s in set(seqs) & set(batch.preempted)]
        assert not set(seqs) & set(batch.preempted), (
            f"{case}, step {step}: expected no sequence both preempted and scheduled, got "
            f"{both}; hint: drop a victim from your queue, and never preempt a sequence "
            "already in this step's batch (re-read batch.busy() after each preemption)"
        )
        assert batch.num_tokens <= POOLS[mode]["max_num_batched_tokens"], (
            f"{case}, step {step}: expected at most {budget} tokens, got {batch.num_tokens}; "
            "hint: n = min(seq.num_uncomputed, budget), then budget -= n"
        )
    assert got == want, (
        f"{case}: expected the tokens of the engine's own scheduler, got other tokens for "
        f"requests {[i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]} "
        f"({len(got)} outputs for {len(want)}); hint: oldest first, preempt the newest, and "
        "reserve slots with append_slots for every sequence scheduled"
    )


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
            f"schedule_running on the recompute pool, step {step}: expected (runs, preempted) "
            f"{b} as the engine's scheduler, got {a}; hint: serve the oldest running sequence "
            "first, and preempt the newest one not in this step"
        )
    assert len(got) == len(want), (
        f"schedule_running on the recompute pool: expected {len(want)} steps as with the "
        f"engine's scheduler, got {len(got)}; hint: serve the oldest first, preempt the newest"
    )


def test_ch08_schedule_running_leaves_the_pool_whole(ch08, bundled):
    """After the run every block is back: nothing leaked by a preemption."""
    model, tok = bundled
    _, _, engine = run_engine(model, tok, ch08.schedule_running, **POOLS["recompute"])
    manager = engine.manager
    assert manager.num_free_blocks == manager.num_blocks, (
        f"an engine with your schedule_running, after the run: expected all "
        f"{manager.num_blocks} blocks free, got {manager.num_free_blocks}; hint: blocks "
        "leaked: preempt only through scheduler._preempt (it frees the victim's blocks), and "
        "call append_slots only for a sequence you schedule"
    )
