"""Where the time of a call goes (kernels, framework, Python), how many ops it dispatches,
its FLOPs, and the machine's roofline (the matmul and copy ceilings measured here)."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.lab.timing import no_gc, time_samples, timed

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
    with no_gc():
        for _ in range(repeats):
            wall = timed(fn)
            with _quiet_stderr(), torch.profiler.profile(activities=activities) as prof:
                profiled = timed(fn)
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
    of one large copy (bytes read + written per second). No real workload goes faster than
    both allow. `read_bytes_per_s`: bytes per second of a pure read (a sum over the copy's
    buffer), the ceiling of a job that streams data in and writes little, such as a batch-1
    decode step reading the weights (0 when not measured)."""

    flops_per_s: float
    bytes_per_s: float
    read_bytes_per_s: float = 0.0

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
    runs: a ceiling is what the machine does when nothing else gets in the way. The read
    bandwidth is a sum over the same buffer: one multiply-add's worth of work per 4 bytes,
    like a matrix-vector product, and no write stream."""
    device = torch.device(device)
    n = matmul_size or (8192 if device.type == "cuda" else 1024)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    src = torch.empty(copy_bytes // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    samples = time_samples(
        {
            "matmul": lambda: torch.mm(a, b),
            "copy": lambda: dst.copy_(src),
            "read": lambda: src.sum(),
        },
        repeats=repeats,
        warmup=1,
    )
    t = {name: min(s) for name, s in samples.items()}
    # A copy reads every byte once and writes it once.
    return Roofline(
        flops_per_s=2 * n**3 / t["matmul"],
        bytes_per_s=2 * copy_bytes / t["copy"],
        read_bytes_per_s=copy_bytes / t["read"],
    )


# ------------------------------------------------------------------------- op counting


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> Counter[str]:
    """How many times each aten op (`aten::mm`, ...) runs while `fn` runs, counted below
    the Python API (what the dispatcher sees: one `F.linear` is a view, a `t`, an `mm`...)."""
    counter = _OpCounter()
    with counter:
        fn()
    return counter.ops


def compute_ops(ops: Counter[str]) -> int:
    """Ops that compute (not views, metadata or allocation): kernel launches on a GPU."""
    return sum(n for name, n in ops.items() if name not in NON_COMPUTE_OPS)


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


@torch.no_grad()
def ops_per_forward(model: nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """Aten ops of one forward over `ids`: all of them, those that compute, and GEMMs.

    Counted under `no_grad`, not `inference_mode`: there the dispatcher shows composite ops
    such as `aten::linear` whole instead of the `t` + `mm` they run as."""
    ops = count_ops(lambda: model(ids))
    gemms = sum(n for name, n in ops.items() if name in GEMM_OPS)
    return {"ops": sum(ops.values()), "compute_ops": compute_ops(ops), "gemms": gemms}


def kernel_shares(fn: Callable[[], Any], top: int = 4, repeats: int = 3) -> dict[str, float]:
    """The `top` compute kernels (innermost compute ops, as `profile_split` counts them)
    by their share of all kernel self time over `repeats` calls: which op a variant's
    time goes to ('aten::mm': 0.62, ...)."""
    fn()
    memo: dict[int, bool] = {}
    totals: Counter[str] = Counter()
    with _quiet_stderr(), torch.profiler.profile() as prof:
        for _ in range(repeats):
            fn()
    for e in prof.events():
        if _is_kernel(e, memo):
            totals[e.name] += e.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {name: t / whole for name, t in totals.most_common(top)}
