"""What ranks 1..N-1 of a parallel engine run (`minillm.engine.parallel` is rank 0's side):
join the group, load the part of the model rank 0 names (a shard of every layer, or a
stage of consecutive layers), then run every step rank 0 broadcasts until it sends None.

A pipeline rank receives the stage before's hidden states, runs its layers and sends them
on to the next rank without waiting for the send to finish: rank 0 sends several steps
before it takes the first one's hidden states back.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from minillm.engine.worker import CacheSettings, Step, Worker
from minillm.model.config import ModelConfig
from minillm.model.parallel import Collectives, SharedMemoryCollectives, load_shard
from minillm.model.pipeline import load_stage, stage_layers
from minillm.model.transformer import Transformer
from minillm.model.weights import load_config

log = logging.getLogger(__name__)

TIMEOUT = timedelta(seconds=float(os.environ.get("MINILLM_DIST_TIMEOUT", "120")))


@dataclass(frozen=True)
class ShardSpec:
    """What rank 0 tells every rank to load: the checkpoint, its dtype and device type."""

    model_dir: str
    dtype: torch.dtype
    device: str  # "cpu" or "cuda" (each rank takes its own GPU)
    threads: int | None  # torch threads per rank (None: the process's default)
    shared_memory: str | None  # the file of SharedMemoryCollectives (None: torch.distributed)
    pipeline: bool = False  # each rank a stage of consecutive layers, not a shard of each

    def load(self, cfg: ModelConfig, rank: int, size: int, comm: Collectives) -> Transformer:
        """This rank's part: its stage (rank r > 0 holds stage r - 1, rank 0 the last), or
        its shard."""
        device = device_of(self, rank)
        if self.pipeline:
            start, end = stage_layers(cfg, size)[(rank - 1) % size]
            return load_stage(self.model_dir, cfg, start, end, self.dtype, device)
        return load_shard(self.model_dir, cfg, rank, size, self.dtype, device, comm)

    def collectives(self, rank: int, size: int) -> Collectives:
        if self.shared_memory is None:
            return Collectives()
        return SharedMemoryCollectives(self.shared_memory, rank, size, TIMEOUT.total_seconds())


def backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    """True when the rendezvous variables are set (torchrun, or by hand): `env://`."""
    return all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))


def broadcast(message: Any) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    return box[0]


def device_of(spec: ShardSpec, rank: int) -> torch.device:
    if spec.device != "cuda":
        return torch.device(spec.device)
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.setdevice_of(local)
    return torch.device("cuda", local)


def run_rank(rank: int, size: int, store: tuple[str, int] | None = None) -> None:
    """Ranks 1..size-1: join the group (through rank 0's store at (host, port), or
    `env://`), load this rank's shard, run every step rank 0 sends until it sends None
    (or goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 gets Ctrl-C and stops us
    if store is None:
        dist.init_process_group(backend(), rank=rank, world_size=size, timeout=TIMEOUT)
    else:
        client = dist.TCPStore(*store, size, is_master=False, timeout=TIMEOUT)
        client.add("joined", 1)  # rank 0 waits for this, watching that we are alive
        dist.init_process_group(
            backend(), store=client, rank=rank, world_size=size, timeout=TIMEOUT
        )
    try:
        spec: ShardSpec | None = broadcast(None)
        if spec is None:  # rank 0 gave up before the start
            return
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        cfg = load_config(spec.model_dir)
        model = spec.load(cfg, rank, size, spec.collectives(rank, size))
        settings: CacheSettings | None = broadcast(None)
        if settings is None:  # rank 0's engine did not start
            return
        worker, stage = Worker(model, settings), _Stage(rank, size) if spec.pipeline else None
        while (step := broadcast(None)) is not None:
            if not isinstance(step, Step):
                continue
            if stage is not None:
                stage.run(worker, step)
                continue
            try:
                worker.execute(step)
            except Exception:  # rank 0 fails on the same step and says whose it was
                log.debug("rank %d: the step failed", rank, exc_info=True)
    finally:
        dist.destroy_process_group()


class _Stage:
    """A pipeline rank's part of each step: receive the stage before's hidden states (rank
    1 starts from token ids), run its layers, send them on. Each message is a status (0: the
    hidden states follow; 1: this step failed on a stage, which logged why) and, if 0, the
    hidden states; rank 0 knows their shape from the step. Sends do not wait: rank 0 sends
    up to `depth` steps before it receives the first one's hidden states."""

    def __init__(self, rank: int, size: int) -> None:
        self.prev = rank - 1 if rank > 1 else None
        self.next = (rank + 1) % size
        self.sending: list[tuple[torch.Tensor, dist.Work]] = []

    def run(self, worker: Worker, step: Step) -> None:
        if not step.ids:  # only block moves: nothing travels
            worker.move_blocks(step)
            return
        hidden = receive_hidden(worker, step, self.prev) if self.prev is not None else None
        if isinstance(hidden, BaseException):
            out = None  # failed upstream: make the block moves, pass the failure on
            worker.move_blocks(step)
        else:
            try:
                out = worker.execute(step, hidden)
            except Exception:
                log.exception("pipeline rank %d: the step failed", dist.get_rank())
                out = None
        # the sends in flight keep their tensors; never wait on one here: the next stage (or
        # rank 0, sending the next steps first) receives it when it gets to it
        self.sending = [(t, work) for t, work in self.sending if not work.is_completed()]
        status = torch.tensor([0 if out is not None else 1])
        self.sending.append((status, dist.isend(status, self.next)))
        if out is not None:
            out = out.contiguous()
            self.sending.append((out, dist.isend(out, self.next)))


def receive_hidden(worker: Worker, step: Step, src: int) -> torch.Tensor | RuntimeError:
    """The hidden states [len(step.ids), hidden] that rank `src` sends for `step`, or the
    error to raise if the step failed there."""
    status = torch.zeros(1, dtype=torch.long)
    dist.recv(status, src)
    if status.item():
        return RuntimeError(f"the step failed on pipeline rank {src} (its log says why)")
    hidden = torch.empty(
        len(step.ids), worker.model.config.hidden_size, dtype=worker.dtype,
        device=worker.device,
    )  # fmt: skip
    dist.recv(hidden, src)
    return hidden
