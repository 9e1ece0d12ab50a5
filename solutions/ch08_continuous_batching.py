"""Chapter 08 answers: the reference for `exercises/ch08_continuous_batching.py`.

Written from scratch in plain Python (no minillm import): the tests run them on fixed
traces, compare the stream functions with `minillm.engine`, and run the engine with
`schedule_running` in place of its own pass.
"""

from __future__ import annotations

from typing import Any


def admission_order(waiting: list[dict], now: int, aging: float) -> list[str]:
    """Ids of the waiting requests, best first: priority minus aging times steps waited."""

    def key(r: dict) -> tuple[float, int, str]:
        return (r["priority"] - aging * (now - r["arrival"]), r["arrival"], r["id"])

    return [r["id"] for r in sorted(waiting, key=key)]


def simulate(requests: list[dict], max_num_seqs: int, aging: float) -> dict[str, tuple[int, int]]:
    """Step-level continuous batching: {id: (first token step, finish step)}."""
    pending = sorted(requests, key=lambda r: (r["arrival"], r["id"]))
    waiting: list[dict] = []
    running: dict[str, int] = {}  # id -> tokens still to produce
    result: dict[str, tuple[int, int]] = {}
    first: dict[str, int] = {}
    step = 0
    while pending or waiting or running:
        while pending and pending[0]["arrival"] <= step:
            waiting.append(pending.pop(0))
        by_id = {r["id"]: r for r in waiting}
        for rid in admission_order(waiting, step, aging):
            if len(running) == max_num_seqs:
                break
            running[rid] = by_id[rid]["output_len"]
            first[rid] = step
            waiting.remove(by_id[rid])
        for rid in list(running):
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
                result[rid] = (first[rid], step)
        step += 1
    return result


def holdback(text: str, stops: list[str]) -> int:
    """Trailing characters of `text` that could begin a stop string (not safe to send)."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def stream_with_stops(pieces: list[str], stops: list[str]) -> tuple[list[str], str]:
    """Stream token texts with stop strings: (one chunk per consumed piece, reason)."""
    text, sent, chunks = "", 0, []
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s and s in text]
        if hits:
            chunks.append(text[sent : min(hits)])
            return chunks, "stop"
        safe = len(text) - holdback(text, stops)
        chunks.append(text[sent:safe])
        sent = max(sent, safe)
    chunks[-1:] = [chunks[-1] + text[sent:]] if chunks else []
    return chunks, "length"


def schedule_running(scheduler: Any, batch: Any, budget: int, prompts: bool) -> int:
    """One pass of the engine's scheduler over its running sequences; the budget left."""
    busy = batch.busy()
    queue = [s for s in scheduler.running if (s.num_uncomputed > 1) == prompts and s not in busy]
    while queue and budget > 0:
        seq = queue.pop(0)  # oldest admission first
        while not scheduler.manager.can_append(seq):
            busy = batch.busy()  # never preempt what this step already runs
            victim = [s for s in scheduler.running if s not in busy][-1]  # the newest
            scheduler._preempt(victim, batch)
            if victim in queue:
                queue.remove(victim)
            if victim is seq:  # it gave its own blocks back: it waits for a later step
                break
        else:
            n = min(seq.num_uncomputed, budget)
            batch.copies += scheduler.manager.append_slots(seq)  # copy-on-write pairs
            batch.items.append(scheduler._item(seq, n))
            budget -= n
    return budget
