"""Tensor parallelism, Megatron-style: one rank's slice of every weight matrix, and the
collectives that make N slices compute what the whole model computes.

A decoder layer splits with two all-reduces and nothing else:

    attention   q, k, v   column-parallel: rank r computes its own heads (q, k, v rows)
                o         row-parallel: its columns for those heads -> a partial sum,
                          all-reduced into the full hidden state
    MLP         gate, up  column-parallel: rank r computes 1/N of the intermediate units
                down      row-parallel: a partial sum, all-reduced

Attention needs no communication at all: a head reads only its own q, k and v, so each
rank attends over its heads' K/V, and its KV cache holds only those heads (1/N of the
cache). The embedding is split by vocabulary rows (each rank looks up the ids it owns, the
others contribute zeros, one all-reduce), and so is the LM head (each rank computes the
logits of its rows, gathered for sampling). Everything else (norms, residuals, RoPE) is
replicated: it is cheap and needs the full hidden state every rank already has.

A shard is the ordinary `Transformer` built from `shard_config` (its heads and
intermediate units are one rank's), with the three layer kinds below in place of the
row-parallel projections, the embedding and the LM head. `load_shard` reads each rank's
slices straight from the safetensors files: no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer
from minillm.model.weights import assign_weights


def check_divides(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming the fix if `size` ranks cannot split this model."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size} must be >= 1")
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and inter % d == 0]
    fits = [d for d in fits if kv % d == 0 or d % kv == 0]
    for what, n in (("num_attention_heads", heads), ("intermediate_size", inter)):
        if n % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide {what}={n}: every rank needs "
                f"the same share of heads and MLP units. Sizes that fit this model: {fits}"
            )
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size} and num_key_value_heads={kv}: one must divide the "
            f"other (fewer KV heads than ranks are replicated). Sizes that fit: {fits}"
        )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's shape: 1/size of the query heads and MLP units; 1/size of the KV heads,
    or one KV head when there are fewer KV heads than ranks (it is replicated, as vLLM does:
    each rank needs the KV head its query heads read). The vocabulary stays whole: the
    embedding and LM head layers know their own rows."""
    check_divides(cfg, size)
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // size),
        intermediate_size=cfg.intermediate_size // size,
        head_dim=cfg.head_dim,
    )


class RankLost(RuntimeError):
    """A collective did not complete: another rank exited or stopped answering."""


@dataclasses.dataclass
class CommStats:
    """What one rank's collectives cost: calls, bytes sent in, seconds inside them (waiting
    for the slowest rank included: that is what a step pays)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Collectives:
    """The two collectives a shard needs, through torch.distributed's default group (gloo
    on a CPU, NCCL on GPUs): `all_reduce` sums a tensor over the ranks in place,
    `all_gather` returns every rank's tensor, in rank order. `stats` adds up their cost."""

    def __init__(self) -> None:
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> None:
        with self._counted(x):
            self._torch(dist.all_reduce, x)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        with self._counted(x):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            self._torch(dist.all_gather, parts, x.contiguous())
        return parts

    @staticmethod
    def _torch(collective, *args: object) -> None:
        try:
            collective(*args)
        except (RuntimeError, dist.DistError) as err:
            raise RankLost(f"a tensor-parallel rank stopped answering ({err})") from err

    @contextlib.contextmanager
    def _counted(self, x: torch.Tensor) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.calls += 1
            self.stats.bytes += x.nbytes
            self.stats.seconds += time.perf_counter() - start


class SharedMemoryCollectives(Collectives):
    """The same collectives for ranks on one machine, through a shared-memory file: each
    rank writes its tensor into its slot, raises its counter, waits (spinning) until every
    counter has reached the call's number, then reads every slot. A call costs a few
    microseconds where gloo's costs about a millisecond on a small VM (chapter 09 measures
    both): a decode step makes two all-reduces a layer, so serving engines bring their own
    (vLLM's CPU backend has a shared-memory one too, and a custom all-reduce on GPUs).

    Two sets of slots take turns, so a rank may write call n + 1 while a slower one still
    reads call n; it cannot get further ahead, since call n + 1 waits for every rank's
    counter. Every rank sums the slots in rank order, so all get the same bits. Tensors
    larger than a slot (long prefills, where a millisecond does not matter) go through
    torch.distributed. x86-64 only: its stores are seen in the order they were made, so a
    raised counter means the slot's data is there; a weakly ordered CPU (ARM) would need
    memory fences that Python cannot make."""

    SLOT_BYTES = 4 * 2**20

    def __init__(self, path: str | Path, rank: int, size: int, timeout_s: float) -> None:
        super().__init__()
        self.rank, self.size, self.timeout_s, self.calls = rank, size, timeout_s, 0
        nbytes = self.file_bytes(size)
        buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        self.counters = buffer[: 8 * size].view(torch.int64).numpy()
        self.slots = buffer[64 * size :].view(2, size, self.SLOT_BYTES)

    @classmethod
    def file_bytes(cls, size: int) -> int:
        """The file's size: room for the counters (64 bytes a rank), then two sets of slots."""
        return 64 * size + 2 * size * cls.SLOT_BYTES

    @classmethod
    def create(cls, path: str | Path, size: int) -> None:
        """The zeroed file every rank maps (rank 0 makes it before the others start)."""
        with open(path, "wb") as f:
            f.truncate(cls.file_bytes(size))

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of x (views into the slots, valid until the next call)."""
        self.calls += 1
        slots = self.slots[self.calls % 2]
        slots[self.rank, : x.nbytes].copy_(x.contiguous().view(-1).view(torch.uint8))
        self.counters[self.rank] = self.calls
        deadline, spins = None, 0
        while self.counters.min() < self.calls:
            spins += 1
            if spins % 4096 == 0:  # a rank that has gone never raises its counter
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise RankLost(
                        f"a tensor-parallel rank stopped answering (no all-reduce in "
                        f"{self.timeout_s:.0f} s)"
                    )
                os.sched_yield()
        return [s[: x.nbytes].view(x.dtype).view(x.shape) for s in slots]

    def all_reduce(self, x: torch.Tensor) -> None:
        if x.nbytes > self.SLOT_BYTES:
            return super().all_reduce(x)
        with self._counted(x):
            parts = self._exchange(x)
            x.copy_(parts[0])
            for part in parts[1:]:
                x.add_(part)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.nbytes > self.SLOT_BYTES:
            return super().all_gather(x)
        with self._counted(x):
            return [p.clone() for p in self._exchange(x)]


class RowParallelLinear(nn.Linear):
    """A linear layer holding its input columns of one rank: each rank's product is a
    partial sum of the full layer's, and one all-reduce adds them up. The bias (whole on
    every rank) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Collectives):
        super().__init__(in_features, out_features, bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self.comm.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows [start, start + num_embeddings) of the vocabulary: ids outside
    them look up zeros, and the all-reduce fills in every id from the rank that owns it."""

    def __init__(self, rows: int, dim: int, start: int, comm: Collectives) -> None:
        super().__init__(rows, dim)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.where(mine, 0), self.weight) * mine[..., None]
        self.comm.all_reduce(out)
        return out


class VocabParallelHead(nn.Linear):
    """The LM head's rows of one rank's vocabulary slice: each rank computes its slice of
    the logits and an all-gather joins them, cut to the real vocabulary (the last slice may
    be padded)."""

    def __init__(self, dim: int, rows: int, vocab_size: int, comm: Collectives) -> None:
        super().__init__(dim, rows, bias=False)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.comm.all_gather(F.linear(x, self.weight))
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def _slices(cfg: ModelConfig, rank: int, size: int) -> dict[str, tuple[int, int, int]]:
    """For each kind of parameter: (dim it is split along, start, end) on this rank."""
    q = cfg.num_attention_heads // size * cfg.head_dim
    inter = cfg.intermediate_size // size
    kv_heads = max(1, cfg.num_key_value_heads // size)
    kv_first = rank * cfg.num_key_value_heads // size  # replicated: the head rank r's q read
    kv = (kv_first * cfg.head_dim, (kv_first + kv_heads) * cfg.head_dim)
    vocab = -(-cfg.vocab_size // size)  # rows per rank, the last slice padded
    return {
        "q_proj.weight": (0, rank * q, (rank + 1) * q),
        "q_proj.bias": (0, rank * q, (rank + 1) * q),
        "k_proj.weight": (0, *kv),
        "k_proj.bias": (0, *kv),
        "v_proj.weight": (0, *kv),
        "v_proj.bias": (0, *kv),
        "o_proj.weight": (1, rank * q, (rank + 1) * q),
        "gate_proj.weight": (0, rank * inter, (rank + 1) * inter),
        "gate_proj.bias": (0, rank * inter, (rank + 1) * inter),
        "up_proj.weight": (0, rank * inter, (rank + 1) * inter),
        "up_proj.bias": (0, rank * inter, (rank + 1) * inter),
        "down_proj.weight": (1, rank * inter, (rank + 1) * inter),
        "embed_tokens.weight": (0, rank * vocab, (rank + 1) * vocab),
        "lm_head.weight": (0, rank * vocab, (rank + 1) * vocab),
    }


def _checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return dict.fromkeys(f.keys(), model_dir / "model.safetensors")


def read_shard(
    model_dir: Path, names: list[str], cfg: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of each tensor in `names`, read from disk slice by slice (each
    safetensors file opened once)."""
    files, slices = _checkpoint_files(model_dir), _slices(cfg, rank, size)
    missing = [n for n in names if n not in files]
    if missing:
        raise ValueError(f"checkpoint {model_dir} has no tensor {missing[0]!r}: is it this model?")
    state = {}
    for file in dict.fromkeys(files[n] for n in names):
        with safe_open(file, "pt") as f:
            for name in (n for n in names if files[n] == file):
                part, kind = f.get_slice(name), ".".join(name.split(".")[-2:])
                if kind not in slices:
                    state[name] = part[:]
                    continue
                dim, start, end = slices[kind]
                stop = min(end, part.get_shape()[dim])
                tensor = part[start:stop] if dim == 0 else part[:, start:stop]
                if stop < end:  # the last vocabulary slice: pad with rows that are never used
                    tensor = F.pad(tensor, (0, 0, 0, end - stop))
                state[name] = tensor
    return state


def load_shard(
    model_dir: str | Path,
    cfg: ModelConfig,
    rank: int,
    size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    comm: Collectives | None = None,
) -> Transformer:
    """Rank `rank`'s shard of the checkpoint in `model_dir` (config `cfg`), in eval mode.
    Its forward takes part in the collectives of `comm` (default: torch.distributed's):
    every rank must run the same forward at the same time (`minillm.engine.parallel` sees
    to it)."""
    comm = comm or Collectives()
    model_dir, local = Path(model_dir), shard_config(cfg, size)
    vocab = -(-cfg.vocab_size // size)
    with torch.device("meta"):
        model = Transformer(local)
        for block in model.model.layers:
            attn, mlp, hidden = block.self_attn, block.mlp, cfg.hidden_size
            attn.o_proj = RowParallelLinear(attn.o_proj.in_features, hidden, cfg.o_bias, comm)
            mlp.down_proj = RowParallelLinear(local.intermediate_size, hidden, cfg.mlp_bias, comm)
        embed = VocabParallelEmbedding(vocab, cfg.hidden_size, rank * vocab, comm)
        model.model.embed_tokens = embed
        model.lm_head = VocabParallelHead(cfg.hidden_size, vocab, cfg.vocab_size, comm)
    names = list(model.state_dict())
    if cfg.tie_word_embeddings:  # the head is the embedding: read once
        names.remove("lm_head.weight")
    state = read_shard(model_dir, names, cfg, rank, size)
    return assign_weights(model, state, dtype, torch.device(device))
