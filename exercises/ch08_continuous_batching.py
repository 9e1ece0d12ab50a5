"""Chapter 08 exercises: a scheduling policy and stop strings in a stream.

Notebook 08 builds `minillm.engine`: every step the scheduler admits waiting requests
into the running batch (continuous batching), and every step each running request gets
one more token, streamed to its client as text. Here you write, in plain Python:

    admission_order    which waiting request joins first: priority with aging
    simulate           a step-level continuous-batching simulator using that order
    holdback           how much of a stream's text might still become a stop string
    stream_with_stops  streaming token texts to a client, cut at the first stop string
    schedule_running   the real scheduler's pass over its running sequences, with
                       preemption, run inside a real engine

Replace each `raise NotImplementedError(...)` with your code. Grade them with

    make grade CH=08    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch08

and one exercise with `-k "ch08 and holdback"`. The answers are in
`solutions/ch08_continuous_batching.py`: try first.
"""

from __future__ import annotations

from typing import Any


def admission_order(waiting: list[dict], now: int, aging: float) -> list[str]:
    """Ids of the waiting requests in the order the scheduler should admit them.

    Each request is a dict {"id": str, "arrival": int (step), "priority": int, ...};
    a *lower* priority number is more urgent (as in vLLM's priority scheduling). Strict
    priority starves: a low-urgency request waits for as long as urgent ones keep
    arriving. **Aging** fixes that: a request's effective priority improves with the
    steps it has waited,

        effective = priority - aging * (now - arrival)

    and requests are ordered by (effective, arrival, id): ties go to the earlier arrival,
    then to the smaller id, so the order is fully determined. aging = 0 is strict
    priority; with equal priorities the order is first-come-first-served.

    Example: now=4, aging=1, A(priority 5, arrival 0) and C(priority 0, arrival 3):
    A's effective priority is 5 - 4 = 1, C's is 0 - 1 = -1, so ["C", "A"].

    Pitfalls: do not modify `waiting`; sort by a key tuple, not by priority alone.
    """
    raise NotImplementedError("ch08: implement admission_order")


def simulate(requests: list[dict], max_num_seqs: int, aging: float) -> dict[str, tuple[int, int]]:
    """Run a continuous-batching schedule step by step; {id: (first_step, finish_step)}.

    Requests are dicts {"id", "arrival", "priority", "output_len"}. At each step
    t = 0, 1, 2, ...:

    1. requests whose arrival <= t join the waiting list;
    2. waiting requests are admitted in `admission_order(waiting, t, aging)` while fewer
       than `max_num_seqs` are running (no token budget, no memory limit, no preemption);
    3. every running request produces one token (a request admitted at step t produces
       its first token at step t: its prefill and first sample);
    4. a request that has produced `output_len` tokens finishes at step t and its slot
       is free for step t + 1 (that is the "continuous" part: it does not wait for the
       rest of the batch).

    Returns, for every request, (step of its first token, step of its last token).
    Loop until nothing is pending, waiting or running (steps with nothing to do still
    count, when requests arrive later).

    Pitfalls: admit at most max_num_seqs *running* (count the ones already running);
    use your own admission_order.
    """
    raise NotImplementedError("ch08: implement simulate")


def holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` a stream must hold back (not send yet).

    A stop string can arrive split across tokens: with stop "\\n\\n", the text "Amen.\\n"
    may be the start of it. Whatever is sent to a client cannot be taken back, so a
    stream keeps back the longest suffix of `text` that is a *proper* prefix of some
    stop string (a full stop string is handled by the caller: it ends the stream).

    Examples: holdback("abc", ["cde"]) == 1 ("c"); holdback("abcd", ["cde"]) == 2
    ("cd"); holdback("abc", ["xyz"]) == 0; holdback("a\\n", ["\\n\\n", "a\\nb"]) == 2.

    Pitfalls: take the longest match over all stop strings; a suffix of length
    len(stop) or more is not a *proper* prefix; `stops` may be empty.
    """
    raise NotImplementedError("ch08: implement holdback")


def stream_with_stops(pieces: list[str], stops: list[str]) -> tuple[list[str], str]:
    """Stream the text of generated tokens, one chunk per token, honouring stop strings.

    `pieces[i]` is the text token i added. After each piece, append to the output one
    chunk: the newly *safe* text, i.e. the text so far minus what `holdback` keeps, minus
    what was already sent (the chunk may be ""). As soon as the text contains a stop
    string (check every stop, take the earliest position), the last chunk is the unsent
    text before that stop and the stream ends with reason "stop" (later pieces are never
    consumed: the engine would not even generate them). If the pieces run out first, the
    last chunk also flushes whatever was held back, and the reason is "length".

    So "".join(chunks) is the full text cut before the first stop string, and no chunk
    ever contains a character of a stop string that did appear.

    Example: pieces ["Hel", "lo", " wor", "ld"], stops ["lo w"] gives
    (["He", "l", ""], "stop").

    Pitfalls: a stop string spanning two pieces; two stops where the later-listed one
    appears first; never send a character twice.
    """
    raise NotImplementedError("ch08: implement stream_with_stops")


def schedule_running(scheduler: Any, batch: Any, budget: int, prompts: bool) -> int:
    """One pass of the engine's scheduler over its running sequences: the method
    `minillm.engine.scheduler.Scheduler._run_running`, which your function replaces in a
    real engine. Returns the token budget left.

    A step serves its running sequences in two passes: first the decodes (`prompts` False:
    sequences with exactly one uncomputed token, the one they sampled last), then the
    prompts still being prefilled (`prompts` True: more than one uncomputed token). In
    each pass, take the running sequences of that kind that this step does not already
    run (`batch.busy()`), oldest first (`scheduler.running` is in admission order), and
    while the budget lasts:

    - make room: while `scheduler.manager.can_append(seq)` is False, preempt the newest
      running sequence that is not busy in this step, `scheduler._preempt(victim, batch)`
      (it frees or swaps the victim's blocks and requeues it). Drop the victim from your
      queue; if the victim was `seq` itself, `seq` runs in a later step: go on with the
      next one;
    - schedule it: n = min(seq.num_uncomputed, budget) tokens (a decode: 1; a prompt: its
      next chunk); `batch.copies += scheduler.manager.append_slots(seq)` reserves its slots
      (returning copy-on-write pairs); `batch.items.append(scheduler._item(seq, n))`;
      budget -= n.

    Pitfalls: re-read `batch.busy()` after each preemption (the batch grew); preempt from
    the newest end, never a sequence already in this step's batch; a preempted sequence
    must not also be scheduled. The tests run a whole engine on a pool too small for its
    requests with your pass in place and compare every token with the engine's own.
    """
    raise NotImplementedError("ch08: implement schedule_running")
