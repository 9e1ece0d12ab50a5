"""Memory as exact counts of tensor bytes: what autograd saves, the peak of tensor memory
while a function runs, and the process's resident size."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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


class _Traffic(TorchDispatchMode):
    """Adds up the bytes of every tensor each non-view aten op takes and returns."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:  # a view moves no data
            tensors = [t for t in tree_leaves((args, kwargs, out)) if _is_dense(t)]
            self.bytes += sum(t.nbytes for t in tensors)
        return out


def tensor_traffic(fn: Callable[[], Any]) -> int:
    """Bytes the ops of `fn` read and write, counted op by op: each op's input and output
    tensors once (a lower bound on memory traffic, ignoring caches). An unfused chain of
    elementwise ops moves its whole tensor once per op; one fused kernel, once."""
    mode = _Traffic()
    with mode:
        fn()
    return mode.bytes
