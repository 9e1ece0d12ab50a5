"""Tensor and pipeline parallelism across processes: one rank per device (or per group of
CPU cores), each holding a part of the model and the KV cache of that part.

Rank 0 is the engine's own process (this module is its side; `minillm.engine.rank` is
what the others run): it schedules, and each step it sends the `Step` to the other ranks
(one pickled broadcast). nano-vLLM has the same shape (its rank 0 writes each
step to shared memory); vLLM sends the scheduler's output to every worker the same way.

- **Tensor parallel** (`TensorParallel`): each rank holds a shard of every layer
  (`minillm.model.parallel`) and runs the step at the same time as the others, meeting at
  the shards' all-reduces; rank 0 samples from the gathered logits.
- **Pipeline parallel** (`PipelineParallel`): each rank holds consecutive layers
  (`minillm.model.pipeline`). Ranks 1..N-1 hold the first stages and rank 0 the last, with
  the LM head, so hidden states go 1 -> 2 -> ... -> 0 and logits never leave rank 0. Rank 0
  sends a step and, without waiting for it, the next one: while it runs the last stage of
  one batch, rank 1 runs the first stage of another (the engine keeps `depth` batches of
  different sequences in flight, as vLLM's pipeline keeps one per virtual engine).

The ranks find each other through torch.distributed: `LLM(tensor_parallel_size=N)` starts
ranks 1..N-1 on this machine and rendezvouses on a free local port; when the process was
launched with torchrun's variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), every rank
is launched on its own (`RANK=1 python -m minillm serve --tensor-parallel-size 2 ...` on one
machine, `RANK=0 ...` on another) and they meet through `env://`. The backend is gloo on a
CPU and NCCL for CUDA tensors.

Failures end, they never hang: a rank that exits or stops answering fails rank 0's next
step with an error that says which (collectives time out after `TIMEOUT`); while the engine
is idle rank 0 sends a keep-alive so that waiting ranks do not time out. Ctrl-C and SIGTERM
reach rank 0, whose `close` stops every rank; the ranks ignore Ctrl-C themselves (a
terminal sends it to every process) and exit when rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import platform
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minillm.cache.paged import PagedKVCache
from minillm.engine.rank import (
    TIMEOUT,
    ShardSpec,
    backend,
    broadcast,
    launched_by_torchrun,
    receive_hidden,
    run_rank,
)
from minillm.engine.worker import CacheSettings, Executor, Step, Worker
from minillm.lab.ranks import free_port
from minillm.model.config import ModelConfig
from minillm.model.parallel import RankLost, SharedMemoryCollectives, check_divides
from minillm.model.pipeline import stage_layers
from minillm.model.weights import load_config

log = logging.getLogger(__name__)

KEEPALIVE_S = 5.0  # an idle rank 0 tells the others it is alive this often
IDLE = "idle"
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where it exists


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block, raise it at its end (on the
    main thread, the only one that receives signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if pressed:
        raise KeyboardInterrupt


class Ranks(Executor):
    """Rank 0's handle on every rank: `model` is its own part; after `attach`,
    `execute(step)` runs a step on all of them and returns the whole model's logits."""

    pipeline = False  # what the ranks hold: shards (False) or stages (True)
    name = "tensor"  # as in tensor_parallel_size

    def __init__(self, model_dir: str | Path, size: int, dtype: torch.dtype, device: str) -> None:
        """Start (or join) ranks 1..size-1 and load rank 0's part of `model_dir`."""
        cfg = load_config(model_dir)
        self.check(cfg, size)
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed group (another parallel "
                "engine?): close() it first, one parallel engine per process"
            )
        self.size, self.procs = size, []
        self.lock, self.failed, self.last_sent = threading.Lock(), None, time.monotonic()
        threads, self.shared_memory = None, None
        self.threads_before = torch.get_num_threads()  # given back by close()
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != size or int(os.environ["RANK"]) != 0:
                raise ValueError(
                    f"WORLD_SIZE={os.environ['WORLD_SIZE']}, RANK={os.environ['RANK']}: this "
                    f"process must be rank 0 of {size} ({self.name}_parallel_size={size}); "
                    "the other ranks run `python -m minillm serve` with their own RANK"
                )
            dist.init_process_group(backend(), rank=0, world_size=size, timeout=TIMEOUT)
        else:  # ranks 1..size-1 on this machine, the cores shared out
            if device == "cuda" and torch.cuda.device_count() < size:
                raise ValueError(
                    f"{self.name}_parallel_size={size} needs {size} GPUs, one a rank, and this "
                    f"machine has {torch.cuda.device_count()}: use device='cpu' (the ranks share "
                    "its cores) or a smaller size"
                )
            threads = max(1, torch.get_num_threads() // size)
            torch.set_num_threads(threads)
            on_x86 = platform.machine().lower() in ("x86_64", "amd64")
            if on_x86 and device == "cpu" and not self.pipeline:
                fd, self.shared_memory = tempfile.mkstemp(prefix="minillm-tp-", dir=SHM_DIR)
                os.close(fd)
                SharedMemoryCollectives.create(self.shared_memory, size)
            self._spawn(size)
        self.keepalive = threading.Thread(target=self._keep_alive, daemon=True)
        self.local: Worker | None = None
        try:
            spec = ShardSpec(
                str(model_dir), dtype, device, threads, self.shared_memory, self.pipeline
            )
            self._send(spec)
            self.comm = spec.collectives(0, size)  # its `stats`: what rank 0's collectives cost
            self.model = spec.load(cfg, 0, size, self.comm)
        except BaseException:
            self.close()
            raise

    def _spawn(self, size: int) -> None:
        """Start ranks 1..size-1 here and form the group, failing at once (not after the
        timeout) if one of them dies first."""
        port = free_port()
        store = dist.TCPStore(
            "127.0.0.1", port, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False
        )
        ctx = mp.get_context("spawn")  # a fresh interpreter: no fork of torch's threads
        for rank in range(1, size):
            proc = ctx.Process(target=run_rank, args=(rank, size, ("127.0.0.1", port)))
            proc.daemon = True
            proc.start()
            self.procs.append(proc)
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while store.add("joined", 0) < size - 1:
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                for proc in self.procs:
                    proc.kill()
                raise RuntimeError(
                    f"{self.name}-parallel ranks did not start ({dead or 'timed out'}; their "
                    "traceback is above). In a script, create the LLM under `if __name__ == "
                    "'__main__':`, as the ranks are new interpreters that import it"
                )
            time.sleep(0.05)
        dist.init_process_group(backend(), store=store, rank=0, world_size=size, timeout=TIMEOUT)

    @staticmethod
    def check(cfg: ModelConfig, size: int) -> None:
        """Raise ValueError naming the fix if `size` ranks cannot split this model."""
        check_divides(cfg, size)

    def attach(self, worker: Worker, settings: CacheSettings) -> Ranks:
        """Every other rank builds its worker with `settings`; rank 0's is `worker`."""
        self.local = worker
        self._send(settings)
        self.keepalive.start()
        return self

    @property
    def decode_mode(self) -> str:
        return self.local.decode_mode  # type: ignore[union-attr]

    @property
    def cache(self) -> PagedKVCache:
        return self.local.cache  # type: ignore[union-attr]

    def execute(self, step: Step) -> torch.Tensor:
        """Send `step` to every rank and run it here: the whole model's logits. Ctrl-C
        waits for the step's end: stopping between two collectives would leave the other
        ranks waiting in one."""
        with self.lock, _ctrl_c_after():
            self._check()
            self._send(step)
            try:
                return self.local.execute(step)  # type: ignore[union-attr]
            except RankLost as err:  # the ranks are out of step for good
                self.failed = str(err)
                raise RuntimeError(f"{err}: restart the engine") from err

    def _send(self, message: Any) -> None:
        try:
            broadcast(message)
        except (RuntimeError, dist.DistError) as err:
            self.failed = f"a {self.name}-parallel rank stopped answering ({err})"
            raise RuntimeError(f"{self.failed}: restart the engine") from err
        self.last_sent = time.monotonic()

    def _check(self) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if dead and self.failed is None:
            self.failed = ", ".join(
                f"{self.name}-parallel rank {r} exited (code {c})" for r, c in dead
            )
        if self.failed is not None:
            raise RuntimeError(f"{self.failed}: restart the engine")

    def _keep_alive(self) -> None:
        while dist.is_initialized() and self.failed is None:
            time.sleep(KEEPALIVE_S / 5)
            with self.lock:
                if not dist.is_initialized() or time.monotonic() - self.last_sent < KEEPALIVE_S:
                    continue
                try:
                    self._check()
                    self._send(IDLE)
                except RuntimeError:
                    return

    def close(self) -> None:
        """Stop every rank and leave the group. Safe to call twice."""
        with self.lock:
            if not dist.is_initialized():
                return
            if self.failed is None:
                try:
                    broadcast(None)
                except RuntimeError:
                    pass  # a rank already gone: nothing to stop there
            dist.destroy_process_group()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if self.shared_memory is not None:
            Path(self.shared_memory).unlink(missing_ok=True)
        torch.set_num_threads(self.threads_before)


class TensorParallel(Ranks):
    """Every rank holds a shard of each layer and runs each step with the others."""


class PipelineParallel(Ranks):
    """Every rank holds a stage; up to `depth` (one a stage) steps are in flight, and their
    logits come back in the order they were submitted."""

    pipeline, name = True, "pipeline"

    def __init__(self, model_dir: str | Path, size: int, dtype: torch.dtype, device: str) -> None:
        super().__init__(model_dir, size, dtype, device)
        self.depth, self.sent, self.done = size, deque(), {}
        self.tickets = itertools.count()
        self.waited_s = 0.0  # rank 0's time waiting for the other ranks: sends and receives

    @staticmethod
    def check(cfg: ModelConfig, size: int) -> None:
        stage_layers(cfg, size)

    def execute(self, step: Step) -> torch.Tensor:
        return self.submit(step)()

    def submit(self, step: Step) -> Callable[[], torch.Tensor]:
        """Send `step` to the first stage; the returned function waits for its hidden states
        and runs the last stage here: the logits."""
        with self.lock, _ctrl_c_after():
            self._check()
            start = time.perf_counter()
            self._send(step)  # waits while rank 1 finishes the step before
            self.waited_s += time.perf_counter() - start
            ticket = next(self.tickets)
            self.sent.append((ticket, step))
        return lambda: self._collect(ticket)

    def _collect(self, ticket: int) -> torch.Tensor:
        """Finish the submitted steps in order up to `ticket` (a later one cannot arrive
        first), keeping what the earlier ones gave for their own callers."""
        with self.lock, _ctrl_c_after():
            while ticket not in self.done:
                earlier, step = self.sent.popleft()
                self.done[earlier] = self._last_stage(step)
        result = self.done.pop(ticket)
        if isinstance(result, BaseException):
            raise result
        return result

    def _last_stage(self, step: Step) -> torch.Tensor | BaseException:
        local: Worker = self.local  # type: ignore[assignment]
        if self.failed is not None:  # an earlier step lost the ranks: nothing will arrive
            return RuntimeError(f"{self.failed}: restart the engine")
        if not step.ids:  # only block moves: nothing travels
            return local.execute(step)
        start = time.perf_counter()
        try:
            hidden = receive_hidden(local, step, self.size - 1)
        except (RuntimeError, dist.DistError) as err:  # the ranks are out of step for good
            self.failed = f"a pipeline rank stopped answering ({err})"
            return RuntimeError(f"{self.failed}: restart the engine")
        self.waited_s += time.perf_counter() - start
        if isinstance(hidden, BaseException):
            local.move_blocks(step)
            return hidden
        try:
            return local.execute(step, hidden)
        except Exception as err:  # this step's own failure: the runner sees whose
            return err
