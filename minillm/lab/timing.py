"""Speed as ratios: time variants A/B interleaved in one run and report how many times the
baseline's time each takes.

The course's machines are shared and noisy: a speed result here is a ratio between
variants timed in alternation in the same run (`time_ratios`), never an absolute time
to compare across machines.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch


def sync_device() -> None:
    """Wait for queued GPU work so a timer measures it (a no-op on CPU-only runs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call takes, queued GPU work included."""
    sync_device()
    t0 = time.perf_counter()
    fn()
    sync_device()
    return time.perf_counter() - t0


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from firing inside a timed call (as
    `timeit` does): a full collection in a large notebook takes milliseconds."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_samples(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int = 10,
    warmup: int = 2,
    progress: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each function, `repeats` samples each, A/B interleaved.

    Each round calls every function once, starting from a different one each round,
    so a slow spell on a shared machine hits all variants alike instead of whichever
    happened to run then. `warmup` rounds run first and are thrown away (first-call
    allocations, lazy init, caches). The garbage collector is paused meanwhile.
    """
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    rounds: Iterable[int] = range(warmup + repeats)
    if progress:
        from tqdm.auto import tqdm

        rounds = tqdm(rounds, desc="timing", leave=False)
    with no_gc():
        for r in rounds:
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                seconds = timed(fns[name])
                if r >= warmup:
                    samples[name].append(seconds)
    return samples


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int = 10,
    warmup: int = 2,
    progress: bool = False,
) -> dict[str, float]:
    """Median seconds per call of each function, measured A/B interleaved (see
    `time_samples`). Divide two entries to get a ratio; that ratio is the result."""
    samples = time_samples(fns, repeats=repeats, warmup=warmup, progress=progress)
    return {name: statistics.median(s) for name, s in samples.items()}


def paired_ratios(samples: Mapping[str, list[float]], baseline: str) -> dict[str, float]:
    """Median over rounds of each function's time divided by the baseline's time in the
    same round (`samples` as `time_samples` returns them).

    A paired estimate: a slow spell (another process taking the core) usually hits
    both members of a round, so it cancels in their ratio, where a ratio of two
    medians can flip between the machine's fast and slow modes.
    """
    base = samples[baseline]
    return {
        name: statistics.median(a / b for a, b in zip(s, base, strict=True))
        for name, s in samples.items()
    }


def time_ratios(
    fns: Mapping[str, Callable[[], Any]],
    baseline: str,
    repeats: int = 10,
    warmup: int = 2,
    progress: bool = False,
) -> dict[str, float]:
    """How many times the baseline's time each function takes (baseline: 1.0). The
    course's speed number.

    Each function is timed in its own A/B run against the baseline, so the two calls
    of a pair are always neighbours in time, and the result is the median of the
    per-round ratios (`paired_ratios`).
    """
    ratios = {baseline: 1.0}
    names = [name for name in fns if name != baseline]
    if progress:
        from tqdm.auto import tqdm

        names = tqdm(names, desc="timing", leave=False)
    for name in names:
        pair = {name: fns[name], baseline: fns[baseline]}
        samples = time_samples(pair, repeats=repeats, warmup=warmup)
        ratios[name] = paired_ratios(samples, baseline)[name]
    return {name: ratios[name] for name in fns}


def kernel_time_ms(
    fn: Callable[[], Any], warmup: int = 5, repeats: int = 25, flush_bytes: int = 256 * 2**20
) -> float:
    """Median milliseconds of one call of a GPU kernel (or of `fn` on a CPU), for bandwidth
    figures: on CUDA each call is timed with CUDA events after overwriting a buffer larger
    than the L2 cache, so data a previous call left in cache cannot inflate the result (what
    `triton.testing.do_bench` does). On a CPU: wall time, median of `repeats` calls."""
    for _ in range(warmup):
        fn()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        samples = []
        for _ in range(repeats):
            samples.append(timed(fn))
        return 1e3 * statistics.median(samples)
    flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends, strict=True):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
