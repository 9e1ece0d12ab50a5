"""Turn a scheduled batch into one forward of the model on the paged KV cache, and sample
each sequence's next token with its own parameters and RNG: token ids in, token ids out.

Decode-only steps have a fast path, as in nano-vLLM and vLLM: the batch is padded to a
bucket size (1, 2, 4, 8, 16, 32, ... up to max_num_seqs) and its inputs written into
buffers that keep their addresses, so the step can be recorded once per bucket as a CUDA
graph and replayed with one launch (`decode_mode="cuda_graph"`, the default on a GPU), or
compiled once per bucket with torch.compile (`"compile"`). `"eager"` runs every step
as Python; `"static"` runs the padded path eagerly (what the graph records, checkable on a
CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from minillm.cache.block_manager import BlockManager
from minillm.cache.paged import PagedKVCache
from minillm.engine.scheduler import Batch
from minillm.generation.sampling import sample
from minillm.model.transformer import Transformer

DECODE_MODES = ("eager", "static", "compile", "cuda_graph")


class ModelRunner:
    """Owns the K/V pool (and its CPU swap pool); `run(batch)` returns the sampled tokens."""

    def __init__(
        self,
        model: Transformer,
        manager: BlockManager,
        use_kernel: bool = False,
        num_swap_blocks: int = 0,
        decode_mode: str = "eager",
        max_batch: int = 32,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode={decode_mode!r}: use one of {DECODE_MODES}")
        if decode_mode == "cuda_graph" and not model.lm_head.weight.is_cuda:
            raise ValueError("decode_mode='cuda_graph' needs the model on a GPU: use 'static'")
        self.model, self.manager, self.decode_mode = model, manager, decode_mode
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch]
        self.buckets.append(max_batch)
        self.max_blocks = manager.blocks_for(model.config.max_position_embeddings)
        self.graphs: dict[tuple[int, int], Any] = {}  # (rows, table width) -> recording
        self.device = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype
        self.cache = PagedKVCache(
            model.config,
            manager.num_blocks,
            manager.block_size,
            dtype,
            self.device,
            use_kernel,
            num_swap_blocks,
            kv_cache_dtype,
        )

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [1, N], positions [1, N], index of each sampled row's last token [rows]).

        All the step's tokens in one row: each one-token item's token (a decode: the last
        sampled token, at position len - 1), then each chunk's tokens at their positions. The
        cache is told the same layout (`plan`), so it knows whose K/V each token is."""
        ids, positions, last = [], [], []
        decode, prefill = [], []
        for item in batch.items:
            seq, start, n = item.seq, item.start, item.num_tokens
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            if item.samplers:
                last.append(len(ids) - 1)
            if n == 1:
                decode.append((seq.block_table, start + 1))
            else:
                prefill.append((seq.block_table, start, n))
        self.cache.plan(decode, prefill)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor([ids]), as_tensor([positions]), as_tensor(last)

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        """Copy blocks (swap out, swap in, copy-on-write), run the forward, and sample one
        token per sampler, in the batch's order. Sequences that share prefix blocks may run
        together: every layer writes all tokens' K/V before any token reads."""
        self.cache.swap(batch.swap_out, out=True)
        self.cache.swap(batch.swap_in, out=False)
        self.cache.copy_blocks(batch.copies)
        samplers = [item.samplers for item in batch.items if item.samplers]
        decode_only = all(item.num_tokens == 1 and item.samplers for item in batch.items)
        if self.decode_mode != "eager" and decode_only and len(batch.items) <= self.buckets[-1]:
            logits = self._static_decode(batch)
        else:
            ids, positions, last = self.inputs(batch)
            logits = self.model(ids, positions, cache=self.cache, logits_at=last)[0]
        return self.sample(logits.float(), samplers) if samplers else []  # []: mid-prompt

    def _static_decode(self, batch: Batch) -> torch.Tensor:
        """A decode-only step padded to its bucket, replayed from the bucket's recording.
        With the Triton kernel the block tables are as wide as the context (the kernel
        reads only each row's length); the gather path reads every column, so its width is
        bucketed too (powers of two) and each (rows, width) pair has its own recording."""
        n = len(batch.items)
        rows = next(b for b in self.buckets if b >= n)
        width = self.max_blocks
        if not self.cache.use_kernel:
            need = max(len(item.seq.block_table) for item in batch.items)
            width = min(self.max_blocks, 1 << (need - 1).bit_length())
        decode = [(item.seq.block_table, item.start + 1) for item in batch.items]
        self.cache.plan_static_decode(decode, rows, width)
        if (rows, width) not in self.graphs:
            self.graphs[rows, width] = self._record(rows)
        ids, positions, out, replay = self.graphs[rows, width]
        tokens = [item.seq.token_ids[item.start] for item in batch.items]
        ids.copy_(torch.tensor([tokens + [0] * (rows - n)]))
        positions.copy_(torch.tensor([[item.start for item in batch.items] + [0] * (rows - n)]))
        replay()
        return out[0, :n]

    def _record(self, bucket: int) -> tuple:
        """Fixed input buffers for a bucket and a function that runs the step on them: a CUDA
        graph's replay, a compiled step, or the eager step."""
        ids = torch.zeros(1, bucket, dtype=torch.long, device=self.device)
        positions = torch.zeros(1, bucket, dtype=torch.long, device=self.device)
        rows = torch.arange(bucket, device=self.device)

        def step() -> torch.Tensor:
            return self.model(ids, positions, cache=self.cache, logits_at=rows)

        if self.decode_mode == "static":
            out = step()
            return ids, positions, out, lambda: out.copy_(step())
        if self.decode_mode == "compile":
            compiled = torch.compile(step, dynamic=False, fullgraph=True)
            out = compiled()
            return ids, positions, out, lambda: out.copy_(compiled())
        stream = torch.cuda.Stream()  # warm up on a side stream, as graph capture requires
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return ids, positions, out, graph.replay

    @staticmethod
    def sample(logits: torch.Tensor, samplers: list[list]) -> list[int]:
        """One token per sampling sequence: row r's logits serve every sequence in
        samplers[r] (the children of a request with n > 1 share their parent's row). Each
        draws from its own params and seeded RNG, so a sequence gets the same tokens alone or
        in any batch; all-greedy steps take one argmax on the device."""
        if all(s.params.greedy for seqs in samplers for s in seqs):
            best = logits.argmax(dim=-1).tolist()
            return [best[r] for r, seqs in enumerate(samplers) for _ in seqs]
        rows, out = logits.cpu(), []  # the sequences' RNGs are CPU generators
        for row, seqs in zip(rows, samplers, strict=True):
            out += [int(sample(row[None], s.params, s.generator)) for s in seqs]
        return out
