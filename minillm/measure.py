"""Measuring tools the notebooks share: speed ratios, autograd and peak memory, where the
time of a call goes, and a machine's roofline.

The course's machines are shared and noisy: a speed result here is a ratio between
variants timed in alternation in the same run (`time_ratios`), never an absolute time
to compare across machines. Memory figures are exact counts of tensor bytes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch.autograd import DeviceType
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ---------------------------------------------------------------------------------- time


def _sync() -> None:
    """Wait for queued GPU work so a timer measures it (a no-op on CPU-only runs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds one call takes, queued GPU work included."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
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
    with _no_gc():
        for r in rounds:
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                seconds = _timed(fns[name])
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


# -------------------------------------------------------------------------------- memory


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def rss_bytes() -> int:
    """Resident memory of this process (everything: Python, libraries, tensors)."""
    return psutil.Process().memory_info().rss


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    st = t.untyped_storage()
    return str(st.device), st.data_ptr()


def saved_tensor_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes autograd saves for the backward pass while `fn` runs.

    Every tensor an op stashes for its gradient passes through
    `torch.autograd.graph.saved_tensors_hooks`' pack hook; we record the storage
    behind it, counting each storage once (several views of one buffer cost one
    buffer). Storages of `exclude` (pass `model.parameters()`) are not counted:
    weights are saved by reference and cost nothing extra. Under `torch.no_grad()`
    or `torch.inference_mode()` nothing is saved and the result is 0.

    The storages are held until `fn` returns, so an address freed and reused inside
    `fn` cannot hide a buffer; when `fn` returns its output, as a training step's
    forward does, that is exactly what the graph keeps alive for `backward()`.
    """
    skip = {_storage_key(t) for t in exclude}
    held: dict[tuple[str, int], torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip:
            held.setdefault(key, t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(st.nbytes() for st in held.values())


@dataclass
class MemoryTrace:
    """Tensor memory allocated while a function ran (weights and inputs not counted)."""

    peak_bytes: int  # most bytes alive at once
    end_bytes: int  # still alive when it returned (its output, saved tensors, ...)
    allocated_bytes: int  # sum of every allocation, freed or not
    allocations: int  # how many tensor buffers were allocated


class _LiveTensorBytes(TorchDispatchMode):
    """Sees every aten op; tracks the storages ops create and frees them via weakrefs."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.total = self.count = 0
        self.keys: set[tuple[str, int]] = set()

    def _freed(self, key: tuple[str, int], nbytes: int) -> None:
        self.keys.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or in-place result shares an input's storage: not a new allocation.
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if _is_dense(t)}
        for t in tree_leaves(out):
            if not _is_dense(t):
                continue
            key, st = _storage_key(t), t.untyped_storage()
            if key in inputs or key in self.keys or st.nbytes() == 0:
                continue
            self.keys.add(key)
            self.live += st.nbytes()
            self.total += st.nbytes()
            self.count += 1
            self.peak = max(self.peak, self.live)
            # PyTorch keeps a storage's Python object alive as long as the buffer
            # lives, so this fires exactly when the buffer is freed.
            weakref.finalize(st, self._freed, key, st.nbytes())
        return out


def _is_dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def trace_tensor_memory(fn: Callable[[], Any], device: str | torch.device = "cpu") -> MemoryTrace:
    """Peak, final and total tensor bytes allocated while `fn` runs.

    On CUDA this reads the caching allocator's own counters. Elsewhere a
    `TorchDispatchMode` watches every aten op, counts each new output storage and
    notices through a weakref when it is freed. Both count tensor buffers only:
    not the allocator's rounding and caching, nor scratch space a library
    allocates inside one kernel. The dispatch mode slows ops down: use it to
    measure memory, never time.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        stats0 = torch.cuda.memory_stats(device)
        out = fn()
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(device)
        base = stats0["allocated_bytes.all.current"]
        trace = MemoryTrace(
            peak_bytes=stats["allocated_bytes.all.peak"] - base,
            end_bytes=stats["allocated_bytes.all.current"] - base,
            allocated_bytes=stats["allocated_bytes.all.allocated"]
            - stats0["allocated_bytes.all.allocated"],
            allocations=stats["allocation.all.allocated"] - stats0["allocation.all.allocated"],
        )
        del out
        return trace
    mode = _LiveTensorBytes()
    with mode:
        out = fn()
    trace = MemoryTrace(mode.peak, mode.live, mode.total, mode.count)
    del out
    return trace


def peak_tensor_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """Most tensor bytes alive at once while `fn` runs, beyond what existed before."""
    return trace_tensor_memory(fn, device).peak_bytes


# ---------------------------------------------------------------------- where time goes

# Aten ops that move no tensor data: views, metadata, allocation, dtype no-ops.
# Their time, like the dispatcher's and the Python interpreter's, is overhead.
NON_COMPUTE_OPS = frozenset(
    "aten::" + name
    for name in (
        "as_strided alias view _unsafe_view _reshape_alias reshape flatten unflatten expand "
        "t transpose permute unsqueeze squeeze slice select narrow split split_with_sizes "
        "chunk unbind detach detach_ lift_fresh empty empty_strided empty_like resize_ "
        "result_type resolve_conj resolve_neg to contiguous dropout set_ size stride numel "
        "is_nonzero _has_compatible_shallow_copy_type"
    ).split()
)


@dataclass
class TimeSplit:
    """Where the wall time of one call goes (seconds per call).

    `kernel_s`: inside the ops that compute (matmul, attention, elementwise); on CUDA,
    device time of the GPU kernels. `framework_s`: inside aten ops but outside those
    kernels (dispatch, composite-op glue, views, allocation). `python_s`: outside any
    aten op: the interpreter running `forward` and `nn.Module.__call__`, and freeing
    tensors, which happens when Python drops the last reference. The three add up to
    `wall_s`, measured without the profiler.
    """

    wall_s: float
    kernel_s: float
    framework_s: float
    python_s: float
    ops: float  # top-level aten ops per call (each one a trip through the dispatcher)
    kernels: float  # compute-op calls per call (on GPU: kernel launches)
    profiled_wall_s: float  # wall time per call under the profiler, for comparison

    @property
    def kernel_fraction(self) -> float:
        return self.kernel_s / self.wall_s

    @property
    def overhead_fraction(self) -> float:
        """Share of wall time not spent computing: Python plus framework."""
        return 1.0 - self.kernel_fraction

    def fractions(self) -> dict[str, float]:
        return {
            "compute kernels": self.kernel_fraction,
            "framework (dispatch, views, alloc)": self.framework_s / self.wall_s,
            "Python": self.python_s / self.wall_s,
        }


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ start/stop log lines); Python's
    own exceptions and warnings still reach the notebook."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _is_aten(e: Any) -> bool:
    return e.name.startswith("aten::")


def _aten_parent(e: Any) -> Any:
    p = e.cpu_parent
    while p is not None and not _is_aten(p):
        p = p.cpu_parent
    return p


def _computes(e: Any, memo: dict[int, bool]) -> bool:
    """Whether e or any aten op below it is a compute op."""
    if e.id not in memo:
        kids = [c for c in e.cpu_children if _is_aten(c)]
        below = any([_computes(c, memo) for c in kids])  # list: visit every child
        memo[e.id] = below or (_is_aten(e) and e.name not in NON_COMPUTE_OPS)
    return memo[e.id]


def _is_kernel(e: Any, memo: dict[int, bool]) -> bool:
    """The innermost compute op: computes itself, no compute op below it."""
    if not _is_aten(e) or e.name in NON_COMPUTE_OPS:
        return False
    return not any(_computes(c, memo) for c in e.cpu_children if _is_aten(c))


def _split_events(events: Any, cuda: bool) -> tuple[float, float, int, int]:
    """(kernel seconds, seconds inside top-level aten ops, top-level ops, kernels)."""
    memo: dict[int, bool] = {}
    top = [e for e in events if _is_aten(e) and _aten_parent(e) is None]
    aten_s = sum(e.cpu_time_total for e in top) / 1e6
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6
    else:
        kernels = [e for e in events if _is_kernel(e, memo)]
        kernel_s = sum(e.self_cpu_time_total for e in kernels) / 1e6
    return kernel_s, aten_s, len(top), len(kernels)


def profile_split(fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> TimeSplit:
    """Split one call's wall time into compute kernels, framework and Python.

    Method: `torch.profiler` records every aten op with its parent and children.
    A *kernel* is an innermost op that computes (not a view, metadata or allocation
    op, see `NON_COMPUTE_OPS`); its self time (its children, e.g. the `empty` that
    allocates its output, taken out) is kernel time. Time inside top-level aten ops
    but not in kernels is framework; the rest of the wall time is Python. On CUDA,
    kernel time is the GPU's busy time and the rest is time the GPU waits for the
    CPU (Python, dispatch, launches).

    Kernel time is not arithmetic: it includes each kernel's fixed cost per call
    (library call set-up, loop set-up, first touch of new memory), which dominates
    at small sizes and which no profiler can separate from the work.

    The profiler's own bookkeeping (a few µs per op on a slow CPU) lands mostly
    outside kernels. So each round times one call without the profiler and one
    with it, back to back, and takes the difference out of the profiled call's
    framework and Python parts. The parts are summed over rounds and scaled to the
    median unprofiled wall time.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for _ in range(warmup):
        fn()
    rounds = []  # seconds of one call: unprofiled, kernel, framework, python, profiled
    with _no_gc():
        for _ in range(repeats):
            wall = _timed(fn)
            with _quiet_stderr(), torch.profiler.profile(activities=activities) as prof:
                profiled = _timed(fn)
            kernel, aten, ops, kernels = _split_events(prof.events(), cuda)
            # On CUDA kernels run asynchronously: all CPU time inside aten ops is overhead.
            framework = aten if cuda else max(aten - kernel, 0.0)
            python = max(profiled - aten, 0.0)
            # The profiler's own cost: what the profiled call took beyond its unprofiled
            # twin, taken out of the non-kernel parts (none if noise made it faster).
            extra = min(max(profiled - wall, 0.0), framework + python)
            keep = 1 - extra / (framework + python) if framework + python > 0 else 0.0
            rounds.append((wall, kernel, framework * keep, python * keep, profiled))
            counts = (ops, kernels)
    median_wall = statistics.median(r[0] for r in rounds)
    # Sums over rounds: the three parts stay additive and the noise averages out.
    kernel, framework, python = (sum(r[i] for r in rounds) for i in (1, 2, 3))
    total = kernel + framework + python
    scale = median_wall / total if total > 0 else 0.0
    return TimeSplit(
        wall_s=median_wall,
        kernel_s=kernel * scale,
        framework_s=framework * scale,
        python_s=python * scale,
        ops=counts[0],
        kernels=counts[1],
        profiled_wall_s=statistics.median(r[4] for r in rounds),
    )


# ------------------------------------------------------------------------------ roofline


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def count_flops(fn: Callable[[], Any]) -> int:
    """Floating-point operations of the matmuls and attention `fn` runs (a multiply-add
    counts 2), from `torch.utils.flop_counter.FlopCounterMode`. Elementwise ops are not
    counted (they are bandwidth, not arithmetic); attention counts the full square,
    as torch does, though a causal kernel may skip the upper half."""
    from torch.utils.flop_counter import FlopCounterMode

    # torch counts the CUDA attention kernels; teach it the CPU one too.
    cpu_attention = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        fn()
    return counter.get_total_flops()


@dataclass
class Roofline:
    """A machine's measured ceilings: the FLOP rate of one large matmul and the bandwidth
    of one large copy. No real workload goes faster than both allow."""

    flops_per_s: float
    bytes_per_s: float

    def seconds(self, flops: float, bytes_moved: float) -> float:
        """The least time a job can take: bound by arithmetic or by memory traffic."""
        return max(flops / self.flops_per_s, bytes_moved / self.bytes_per_s)


def measure_roofline(
    device: str | torch.device = "cpu",
    matmul_size: int | None = None,
    copy_bytes: int = 256 * 2**20,
    repeats: int = 3,
) -> Roofline:
    """Measure the ceilings on this machine, in the current thread setting: an fp32
    matmul of `matmul_size`² (default 1024 on CPU, 8192 on GPU) and a copy of
    `copy_bytes` (the default is far larger than any cache: main-memory bandwidth; a
    smaller buffer measures the cache it fits in). Each is the best of `repeats`
    runs: a ceiling is what the machine does when nothing else gets in the way."""
    device = torch.device(device)
    n = matmul_size or (8192 if device.type == "cuda" else 1024)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    src = torch.empty(copy_bytes // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    samples = time_samples(
        {"matmul": lambda: torch.mm(a, b), "copy": lambda: dst.copy_(src)},
        repeats=repeats,
        warmup=1,
    )
    t = {name: min(s) for name, s in samples.items()}
    # A copy reads every byte once and writes it once.
    return Roofline(flops_per_s=2 * n**3 / t["matmul"], bytes_per_s=2 * copy_bytes / t["copy"])
