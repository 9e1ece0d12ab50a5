"""The model and its KV cache on one device: a `Step` in, logits out.

A `Step` is one forward written as plain lists (token ids, positions, the rows that get
logits, whose block table each token belongs to, the block copies to make first), so that
rank 0 of a tensor-parallel engine can send it to every other rank as it is
(`minillm.engine.parallel`): each rank's `Worker` runs the same step on its shard and its
slice of the cache, and the shards' collectives make their logits the whole model's.

Decode-only steps may take the padded path (`Step.bucket`), as in nano-vLLM and vLLM: the
batch is padded to a bucket size and its inputs written into buffers that keep their
addresses, so the step can be recorded once per bucket as a CUDA graph and replayed with
one launch (`decode_mode="cuda_graph"`, the default on a GPU), or compiled once per bucket
with torch.compile (`"compile"`); `"static"` runs the padded path eagerly (what the graph
records, checkable on a CPU).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minillm.cache.paged import PagedKVCache
from minillm.model.transformer import Transformer

Pairs = list[tuple[int, int]]


@dataclass(frozen=True)
class CacheSettings:
    """What every rank needs to build its slice of the KV pool alike."""

    num_blocks: int
    block_size: int
    use_kernel: bool = False
    num_swap_blocks: int = 0
    decode_mode: str = "eager"
    kv_cache_dtype: str = "auto"


@dataclass
class Step:
    """One forward. Its tokens form one row: first the one-token decode rows (`decode`:
    their block tables), then each prompt chunk ((block table, number of tokens)); `rows`
    are the indices along it that get logits. The block moves come first (swap out, swap
    in, copy-on-write). `bucket` (rows, table width): the padded decode path."""

    ids: list[int]
    positions: list[int]
    rows: list[int]
    decode: list[list[int]]
    prefill: list[tuple[list[int], int]] = field(default_factory=list)
    swap_out: Pairs = field(default_factory=list)
    swap_in: Pairs = field(default_factory=list)
    copies: Pairs = field(default_factory=list)
    bucket: tuple[int, int] | None = None


class Executor(ABC):
    """What runs steps. `execute(step)` runs one now; `submit(step)` starts one and returns
    what to call for its logits. Only a pipeline has several steps in flight (`depth`, one
    a stage); everything else runs the step when that is called."""

    depth = 1

    @abstractmethod
    def execute(self, step: Step) -> torch.Tensor:
        """The step's logits [len(rows), vocab]."""

    def submit(self, step: Step) -> Callable[[], torch.Tensor]:
        return lambda: self.execute(step)


class Worker(Executor):
    """Owns a model (or one rank's shard or stage of it) and its K/V pool; `execute(step)`
    runs it (`hidden`: a pipeline stage's input, the stage before's output)."""

    def __init__(self, model: Transformer, settings: CacheSettings) -> None:
        weight = model.model.layers[0].input_layernorm.weight  # a stage may have no head
        if settings.decode_mode == "cuda_graph" and not weight.is_cuda:
            raise ValueError("decode_mode='cuda_graph' needs the model on a GPU: use 'static'")
        self.model, self.decode_mode = model, settings.decode_mode
        self.device, self.dtype = weight.device, weight.dtype
        self.cache = PagedKVCache(
            model.config,
            settings.num_blocks,
            settings.block_size,
            self.dtype,
            self.device,
            settings.use_kernel,
            settings.num_swap_blocks,
            settings.kv_cache_dtype,
        )
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, table width) -> recording

    @torch.inference_mode()
    def execute(self, step: Step, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Make the step's block moves, run its forward: logits [len(rows), vocab] (a
        pipeline stage before the last: hidden states [len(ids), hidden], as `hidden`
        comes in)."""
        self.move_blocks(step)
        if not step.ids:  # a step that only preempts: its block moves are all it does
            return torch.empty(0, device=self.device)
        if step.bucket is not None:
            return self._replay(step)
        self.cache.plan(step.decode, step.prefill)
        ids, positions, rows = (self._tensor(x) for x in (step.ids, step.positions, step.rows))
        x = ids[None] if hidden is None else hidden[None]
        return self.model(x, positions[None], cache=self.cache, logits_at=rows)[0]

    def move_blocks(self, step: Step) -> None:
        """Swap out, swap in, copy-on-write: the block moves that come before the forward."""
        self.cache.swap(step.swap_out, out=True)
        self.cache.swap(step.swap_in, out=False)
        self.cache.copy_blocks(step.copies)

    def close(self) -> None:
        """Nothing to release on one device (the parallel workers' `close` stops ranks)."""

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _replay(self, step: Step) -> torch.Tensor:
        """A padded decode step, replayed from its bucket's recording (made on first use)."""
        rows, width = step.bucket  # type: ignore[misc]
        self.cache.plan_static_decode(step.decode, rows, width)
        step_ids, step_positions = torch.tensor([step.ids]), torch.tensor([step.positions])
        if step.bucket not in self.graphs:  # recording runs the step: on this step's inputs
            self.graphs[rows, width] = self._record(step_ids, step_positions)
        ids, positions, out, replay = self.graphs[rows, width]
        ids.copy_(step_ids)
        positions.copy_(step_positions)
        replay()
        return out[0, : len(step.decode)]

    def _record(self, first_ids: torch.Tensor, first_positions: torch.Tensor) -> tuple:
        """Fixed input buffers for a bucket, holding the first step's inputs (recording runs
        the step, and its K/V writes land where that step's tokens go), and a function that
        runs the step on them: a CUDA graph's replay, a compiled step, or the eager step."""
        ids, positions = first_ids.to(self.device), first_positions.to(self.device)
        rows = torch.arange(ids.shape[1], device=self.device)

        def step() -> torch.Tensor:
            return self.model(ids, positions, cache=self.cache, logits_at=rows)

        replay: Callable[[], object]
        if self.decode_mode == "static":
            out = step()
            replay = lambda: out.copy_(step())  # noqa: E731
        elif self.decode_mode == "compile":
            compiled = torch.compile(step, dynamic=False, fullgraph=True)
            out = compiled()
            replay = lambda: out.copy_(compiled())  # noqa: E731
        else:
            stream = torch.cuda.Stream()  # warm up on a side stream, as capture requires
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            replay = graph.replay
        return ids, positions, out, replay
