"""Tensor parallelism across processes: one rank per device (or per group of CPU cores),
each holding a shard of the model (`minillm.model.parallel`) and its slice of the KV cache.

Rank 0 is the engine's own process: it schedules, and each step it sends the `Step` to the
other ranks (one pickled broadcast), then runs it on its own shard. Every rank runs the
same forward at the same time, meeting at the shards' all-reduces; rank 0 samples from the
gathered logits, the others drop theirs. nano-vLLM has the same shape (its rank 0 writes
each step to shared memory); vLLM sends the scheduler's output to every worker the same
way.

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
import logging
import multiprocessing as mp
import os
import platform
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minillm.cache.paged import PagedKVCache
from minillm.engine.worker import CacheSettings, Step, Worker
from minillm.lab.ranks import free_port
from minillm.model.parallel import (
    Collectives,
    RankLost,
    SharedMemoryCollectives,
    check_divides,
    load_shard,
)
from minillm.model.weights import load_config

log = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=float(os.environ.get("MINILLM_DIST_TIMEOUT", "120")))
KEEPALIVE_S = 5.0  # an idle rank 0 tells the others it is alive this often
IDLE = "idle"
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory, not disk, where it exists


@dataclass(frozen=True)
class ShardSpec:
    """What rank 0 tells every rank to load: the checkpoint, its dtype and device type."""

    model_dir: str
    dtype: torch.dtype
    device: str  # "cpu" or "cuda" (each rank takes its own GPU)
    threads: int | None  # torch threads per rank (None: the process's default)
    shared_memory: str | None  # the file of SharedMemoryCollectives (None: torch.distributed)

    def collectives(self, rank: int, size: int) -> Collectives:
        if self.shared_memory is None:
            return Collectives()
        return SharedMemoryCollectives(self.shared_memory, rank, size, TIMEOUT.total_seconds())


def _backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    """True when the rendezvous variables are set (torchrun, or by hand): `env://`."""
    return all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))


def _broadcast(message: Any) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    return box[0]


def _device(spec: ShardSpec, rank: int) -> torch.device:
    if spec.device != "cuda":
        return torch.device(spec.device)
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def run_rank(rank: int, size: int, store: tuple[str, int] | None = None) -> None:
    """Ranks 1..size-1: join the group (through rank 0's store at (host, port), or
    `env://`), load this rank's shard, run every step rank 0 sends until it sends None
    (or goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 gets Ctrl-C and stops us
    if store is None:
        dist.init_process_group(_backend(), rank=rank, world_size=size, timeout=TIMEOUT)
    else:
        client = dist.TCPStore(*store, size, is_master=False, timeout=TIMEOUT)
        client.add("joined", 1)  # rank 0 waits for this, watching that we are alive
        dist.init_process_group(
            _backend(), store=client, rank=rank, world_size=size, timeout=TIMEOUT
        )
    try:
        spec: ShardSpec | None = _broadcast(None)
        if spec is None:  # rank 0 gave up before the start
            return
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        cfg, comm = load_config(spec.model_dir), spec.collectives(rank, size)
        device = _device(spec, rank)
        model = load_shard(spec.model_dir, cfg, rank, size, spec.dtype, device, comm)
        settings: CacheSettings | None = _broadcast(None)
        if settings is None:  # rank 0's engine did not start
            return
        worker = Worker(model, settings)
        while (step := _broadcast(None)) is not None:
            if isinstance(step, Step):
                try:
                    worker.execute(step)
                except Exception:  # rank 0 fails on the same step and says whose it was
                    log.debug("rank %d: the step failed", rank, exc_info=True)
    finally:
        dist.destroy_process_group()


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


class TensorParallel:
    """Rank 0's handle on every rank: `model` is its own shard; after `attach`,
    `execute(step)` runs a step on all of them and returns the whole model's logits."""

    def __init__(self, model_dir: str | Path, size: int, dtype: torch.dtype, device: str) -> None:
        """Start (or join) ranks 1..size-1 and load rank 0's shard of `model_dir`."""
        cfg = load_config(model_dir)
        check_divides(cfg, size)
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed group (another tensor-parallel "
                "engine?): close() it first, one tensor-parallel engine per process"
            )
        self.size, self.procs = size, []
        self.lock, self.failed, self.last_sent = threading.Lock(), None, time.monotonic()
        threads, self.shared_memory = None, None
        self.threads_before = torch.get_num_threads()  # given back by close()
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != size or int(os.environ["RANK"]) != 0:
                raise ValueError(
                    f"WORLD_SIZE={os.environ['WORLD_SIZE']}, RANK={os.environ['RANK']}: this "
                    f"process must be rank 0 of {size} (tensor_parallel_size={size}); the "
                    "other ranks run `python -m minillm serve` with their own RANK"
                )
            dist.init_process_group(_backend(), rank=0, world_size=size, timeout=TIMEOUT)
        else:  # ranks 1..size-1 on this machine, the cores shared out
            if device == "cuda" and torch.cuda.device_count() < size:
                raise ValueError(
                    f"tensor_parallel_size={size} needs {size} GPUs, one a rank, and this "
                    f"machine has {torch.cuda.device_count()}: use device='cpu' (the ranks share "
                    "its cores) or a smaller size"
                )
            threads = max(1, torch.get_num_threads() // size)
            torch.set_num_threads(threads)
            if platform.machine().lower() in ("x86_64", "amd64") and device == "cpu":
                fd, self.shared_memory = tempfile.mkstemp(prefix="minillm-tp-", dir=SHM_DIR)
                os.close(fd)
                SharedMemoryCollectives.create(self.shared_memory, size)
            self._spawn(size)
        self.keepalive = threading.Thread(target=self._keep_alive, daemon=True)
        self.local: Worker | None = None
        try:
            spec = ShardSpec(str(model_dir), dtype, device, threads, self.shared_memory)
            self._send(spec)
            self.comm = spec.collectives(0, size)  # its `stats`: what rank 0's collectives cost
            device_0 = _device(spec, 0)
            self.model = load_shard(model_dir, cfg, 0, size, dtype, device_0, self.comm)
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
                    f"tensor-parallel ranks did not start ({dead or 'timed out'}; their "
                    "traceback is above). In a script, create the LLM under `if __name__ == "
                    "'__main__':`, as the ranks are new interpreters that import it"
                )
            time.sleep(0.05)
        dist.init_process_group(_backend(), store=store, rank=0, world_size=size, timeout=TIMEOUT)

    def attach(self, worker: Worker, settings: CacheSettings) -> TensorParallel:
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
            _broadcast(message)
        except (RuntimeError, dist.DistError) as err:
            self.failed = f"a tensor-parallel rank stopped answering ({err})"
            raise RuntimeError(f"{self.failed}: restart the engine") from err
        self.last_sent = time.monotonic()

    def _check(self) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if dead and self.failed is None:
            self.failed = ", ".join(f"tensor-parallel rank {r} exited (code {c})" for r, c in dead)
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
                    _broadcast(None)
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
