"""Chapter 07's KV memory, counted rather than timed (exact, no noise): a ShareGPT-like
trace replayed against a fixed KV budget, contiguous reservations vs paged blocks
(`simulate`, `fragmentation`), and prefix sharing on the real BlockManager
(`shared_system_prompt`, `parallel_sampling`). `python -m benchmarks.paged` prints the
tables; its docstring (benchmarks/paged.py) says what each policy and part measures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minillm.bench.workload import SEED
from minillm.cache import BlockManager, OutOfBlocks
from minillm.cache.block_manager import PagedSequence

MAX_LEN = 2048
BUDGET = 15_360  # token slots: ~12 GB of OPT-13B KV (0.8 MB/token), the vLLM paper's setup
PROMPT_MEAN, PROMPT_SIGMA = 161.0, 1.0
OUTPUT_MEAN, OUTPUT_SIGMA = 338.0, 0.9
PARTS = ("tokens", "reserved", "internal", "external", "free")


def make_trace(n: int, seed: int = SEED) -> list[tuple[int, int]]:
    """n (prompt_len, output_len) pairs: lognormal with the means above, clipped so
    1 <= prompt, 1 <= output and prompt + output <= MAX_LEN."""
    rng = np.random.default_rng(seed)

    def lognormal(mean: float, sigma: float) -> np.ndarray:
        return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n)  # E[x] = mean

    prompts = np.clip(lognormal(PROMPT_MEAN, PROMPT_SIGMA).round(), 1, MAX_LEN - 1).astype(int)
    outputs = np.clip(lognormal(OUTPUT_MEAN, OUTPUT_SIGMA).round(), 1, None).astype(int)
    outputs = np.minimum(outputs, MAX_LEN - prompts)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


# ------------------------------------------------------------------ (a) fragmentation


class FirstFit:
    """Contiguous regions in one address space of `size` slots, placed first-fit."""

    def __init__(self, size: int) -> None:
        self.size, self.regions = size, {}  # request id -> (start, length)

    def alloc(self, rid: int, length: int) -> bool:
        start = 0
        for s, n in sorted(self.regions.values()):
            if s - start >= length:
                break
            start = s + n
        if start + length > self.size:
            return False
        self.regions[rid] = (start, length)
        return True

    def free(self, rid: int) -> None:
        del self.regions[rid]


@dataclass
class Request:
    """One request of the trace as the simulator sees it: lengths and progress."""

    rid: int
    prompt: int
    output: int
    done: int = 0  # tokens generated so far

    @property
    def final(self) -> int:
        return self.prompt + self.output

    @property
    def stored(self) -> int:  # tokens whose K/V are in the cache now
        return self.prompt + self.done


def reserve(policy: str, r: Request) -> int:
    """Slots a contiguous policy reserves for a request."""
    if policy == "contiguous-max":
        return MAX_LEN
    if policy == "contiguous-pow2":
        return 1 << (r.final - 1).bit_length()
    return r.final  # oracle


def simulate(
    trace: Sequence[tuple[int, int]], policy: str, budget: int = BUDGET, block_size: int = 16
) -> dict[str, Any]:
    """Replay the trace; return the time-averaged split of the budget (PARTS), the mean
    number of running requests, steps taken, preemptions and their cost. Averages cover the
    steps during which requests were still waiting.

    A preempted request starts again from its prompt: the decode steps that regenerate its
    tokens are counted in `steps` (so output tokens per step is a throughput proxy that
    pays for them), while its prompt's second prefill is not a step here; it is reported
    as `reprefilled` tokens instead."""
    queue = [Request(i, p, o) for i, (p, o) in enumerate(trace)]
    queue.reverse()  # pop() from the end = FCFS
    paged = policy.startswith("paged")
    if paged:
        manager = BlockManager(budget // block_size, block_size, prefix_cache=False)
        seqs: dict[int, PagedSequence] = {}  # a request's tokens and block table
    else:
        space = FirstFit(budget)
    running: list[Request] = []
    sums, busy_steps, steps, preemptions = dict.fromkeys(PARTS, 0.0), 0, 0, 0
    running_sum, reprefilled = 0, 0
    while queue or running:
        blocked_need = 0  # slots the head of the queue needed and could not get
        while queue:  # admit in order while the head fits
            r = queue[-1]
            if paged:
                seqs[r.rid] = PagedSequence([0] * r.stored)
                ok = manager.can_allocate(seqs[r.rid])
                if ok:
                    manager.allocate(seqs[r.rid])
            else:
                ok = space.alloc(r.rid, reserve(policy, r))
            if not ok:
                blocked_need = r.stored if paged else reserve(policy, r)
                break
            running.append(queue.pop())
        # account the memory as it is during this step
        if queue:
            busy_steps += 1
            running_sum += len(running)
            if paged:
                alloc = {r.rid: len(seqs[r.rid].block_table) * block_size for r in running}
            else:
                alloc = {r.rid: space.regions[r.rid][1] for r in running}
            tokens = sum(r.stored for r in running)
            reserved = sum(min(alloc[r.rid], r.final) - r.stored for r in running)
            internal = sum(alloc[r.rid] - min(alloc[r.rid], r.final) for r in running)
            free = budget - sum(alloc.values())
            external = free if blocked_need and free >= blocked_need else 0  # holes
            if paged:
                external = 0  # any free block serves any request
            values = (tokens, reserved, internal, external, free - external)
            for part, v in zip(PARTS, values, strict=True):
                sums[part] += v / budget
        # one decode step: every running request produces a token
        steps += 1
        for r in list(running):
            if r not in running:  # preempted earlier in this step
                continue
            if paged:
                while True:
                    try:
                        seqs[r.rid].token_ids.append(0)
                        manager.append_slots(seqs[r.rid])
                        manager.mark_computed(seqs[r.rid], len(seqs[r.rid]))
                        break
                    except OutOfBlocks:  # preempt the newest request (recompute later)
                        seqs[r.rid].token_ids.pop()
                        victim = running.pop()
                        manager.free(seqs[victim.rid])
                        reprefilled += victim.prompt
                        victim.done = 0
                        queue.append(victim)
                        preemptions += 1
                        if victim is r:
                            break
                if r not in running:
                    continue
            r.done += 1
            if r.done == r.output:
                running.remove(r)
                manager.free(seqs[r.rid]) if paged else space.free(r.rid)
    n = max(busy_steps, 1)
    return {
        "policy": policy,
        **{p: sums[p] / n for p in PARTS},
        "mean_running": running_sum / n,
        "steps": steps,
        "preemptions": preemptions,
        "tokens_per_step": sum(o for _, o in trace) / steps,
        "reprefilled": reprefilled,
    }


POLICIES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle")
BLOCK_SIZES = (8, 16, 32)


def fragmentation(trace: Sequence[tuple[int, int]], budget: int = BUDGET) -> list[dict[str, Any]]:
    """`simulate` under each contiguous policy and each paged block size, on one trace."""
    rows = [simulate(trace, p, budget) for p in POLICIES]
    rows += [simulate(trace, f"paged-{b}", budget, b) for b in BLOCK_SIZES]
    return rows


def print_fragmentation(rows: list[dict[str, Any]], trace: Sequence[tuple[int, int]]) -> None:
    """Part (a)'s table: the trace's lengths, then one row per policy (`fragmentation`)."""
    p = np.array([t[0] for t in trace])
    o = np.array([t[1] for t in trace])
    print(
        f"\n(a) fragmentation: {len(trace)} requests, prompt mean {p.mean():.0f} / median "
        f"{np.median(p):.0f} / max {p.max()}, output mean {o.mean():.0f} / median "
        f"{np.median(o):.0f} / max {o.max()}; budget {BUDGET} slots, max_len {MAX_LEN}"
    )
    head = f"{'policy':<18}" + "".join(f"{c:>10}" for c in PARTS)
    print(head + f"{'running':>9}{'steps':>8}{'tok/step':>9}{'preempt':>8}{'re-prefill':>11}")
    for r in rows:
        cells = "".join(f"{r[c]:>10.1%}" for c in PARTS)
        print(
            f"{r['policy']:<18}{cells}{r['mean_running']:>9.1f}{r['steps']:>8}"
            f"{r['tokens_per_step']:>9.1f}{r['preemptions']:>8}{r['reprefilled']:>11}"
        )


# ------------------------------------------------------------------ (b) prefix sharing


def shared_system_prompt(
    trace: Sequence[tuple[int, int]], system_len: int = 512, block_size: int = 16
) -> dict[str, Any]:
    """All requests' prompts = one system prompt + their own user text, all resident at
    once: blocks and prefill tokens with the prefix cache vs without."""
    rng = np.random.default_rng(SEED)
    system = rng.integers(0, 32000, system_len).tolist()
    prompts = [system + rng.integers(0, 32000, p).tolist() for p, _ in trace]
    out = {"requests": len(prompts), "system_len": system_len, "block_size": block_size}
    for cache in (False, True):
        need = sum(-(-len(p) // block_size) for p in prompts)
        m = BlockManager(need, block_size, prefix_cache=cache)
        computed = 0
        for p in prompts:  # one after another: each prefill is done before the next arrives
            seq = PagedSequence(list(p))
            computed += len(p) - m.allocate(seq)
            m.mark_computed(seq, len(p))
        key = "cached" if cache else "plain"
        out[f"{key}_blocks"] = m.num_blocks - m.num_free_blocks
        out[f"{key}_prefill_tokens"] = computed
    out["memory_saved"] = 1 - out["cached_blocks"] / out["plain_blocks"]
    out["prefill_skipped"] = 1 - out["cached_prefill_tokens"] / out["plain_prefill_tokens"]
    return out


def parallel_sampling(
    trace: Sequence[tuple[int, int]], n: int, block_size: int = 16, seed: int = SEED
) -> dict[str, Any]:
    """n samples per request (outputs of independent lengths drawn around the trace's),
    forked from one prompt: blocks held when all samples finished vs n full copies."""
    rng = np.random.default_rng(seed + n)
    shared = copies = 0
    for p, o in trace:
        lengths = np.clip(rng.lognormal(math.log(o), 0.3, n).round(), 1, MAX_LEN - p).astype(int)
        m = BlockManager(n * (-(-MAX_LEN // block_size) + 1), block_size, prefix_cache=False)
        samples = [PagedSequence([0] * p) for _ in range(n)]
        m.allocate(samples[0])
        m.mark_computed(samples[0], p)
        for child in samples[1:]:
            m.fork(samples[0], child)
        for seq, length in zip(samples, lengths, strict=True):
            for _ in range(int(length)):
                seq.token_ids.append(0)
                m.append_slots(seq)
                m.mark_computed(seq, len(seq))
        shared += m.num_blocks - m.num_free_blocks
        copies += sum(-(-(p + int(length)) // block_size) for length in lengths)
    return {"n": n, "blocks_shared": shared, "blocks_copies": copies, "saved": 1 - shared / copies}


def print_sharing(sys_rows: list[dict[str, Any]], par_rows: list[dict[str, Any]]) -> None:
    """Part (b)'s tables: `shared_system_prompt` rows, then `parallel_sampling` rows."""
    print("\n(b) prefix sharing (BlockManager, blocks of 16)")
    print(f"{'system prompt':>14}{'requests':>9}{'blocks':>14}{'memory saved':>14}", end="")
    print(f"{'prefill skipped':>17}")
    for r in sys_rows:
        blocks = f"{r['plain_blocks']}->{r['cached_blocks']}"
        print(
            f"{r['system_len']:>14}{r['requests']:>9}{blocks:>14}{r['memory_saved']:>14.1%}"
            f"{r['prefill_skipped']:>17.1%}"
        )
    print(f"{'parallel n':>14}{'blocks (copies -> forked)':>30}{'memory saved':>14}")
    for r in par_rows:
        blocks = f"{r['blocks_copies']}->{r['blocks_shared']}"
        print(f"{r['n']:>14}{blocks:>30}{r['saved']:>14.1%}")
