"""Run one function on N ranks (processes joined by a gloo group) and collect what each
returns: `run_ranks(fn, 2, x)` calls `fn(rank, size, x)` on ranks 0 and 1 at once.

For trying collectives from a notebook: chapter 09 shows its all-reduces with it, and its
exercise grades a tensor-parallel MLP on two ranks. A function defined in a notebook cannot
be imported by a new process, so such a function travels as its source (`Portable`) and is
re-run there, with `torch`, `F` (torch.nn.functional) and `dist` (torch.distributed) in
scope: it must not use other names from the notebook.
"""

from __future__ import annotations

import inspect
import queue
import socket
import textwrap
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


class Portable:
    """A function that another process can call: itself when it can be imported there, or
    its source, compiled on the first call."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.name, self.fn, self.source = fn.__name__, fn, None
        if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:  # not importable
            self.fn, self.source = None, textwrap.dedent(inspect.getsource(fn))

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:
            scope: dict[str, Any] = {"torch": torch, "F": F, "dist": dist}
            exec(compile(self.source, f"<{self.name}>", "exec"), scope)  # the notebook's cell
            self.fn = scope[self.name]
        return self.fn(*args)


def _rank(rank: int, size: int, port: int, fn: Any, args: tuple, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        out.put((rank, True, fn(rank, size, *args)))
    except Exception:
        out.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """`fn(rank, size, *args)` on `size` gloo ranks of this machine; their results, in rank
    order. A rank's exception is raised here with that rank's traceback. Functions among
    `args` travel as `Portable`s."""
    target, ctx, port = Portable(fn), mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    args = tuple(Portable(a) if inspect.isfunction(a) else a for a in args)
    procs = [
        ctx.Process(target=_rank, args=(r, size, port, target, args, out)) for r in range(size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, ok, value = out.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} of {size} failed:\n{value}")
            results[rank] = value
    except queue.Empty:
        raise TimeoutError(f"the {size} ranks did not all answer in {timeout:.0f} s") from None
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(size)]
