"""Turn a scheduled batch into one forward of the model on the paged KV cache, and sample
each sequence's next token with its own parameters and RNG: token ids in, token ids out.

Decode-only steps have a fast path, as in nano-vLLM and vLLM: the batch is padded to a
bucket size (1, 2, 4, 8, 16, 32, ... up to max_num_seqs) and its inputs written into
buffers that keep their addresses, so the step can be recorded once per bucket as a CUDA
graph and replayed with one launch (`decode_mode="cuda_graph"`, the default on a GPU), or
compiled once per bucket with torch.compile (`"compile"`). `"eager"` runs every step
as Python; `"static"` runs the padded path eagerly (what the graph records, checkable on a
CPU).

A failure is kept to the request that caused it. Each sequence draws its token on its own,
so a sampler that raises fails only its sequence. If the batched forward raises, the step's
shares are run again one at a time (the block copies are done, and rewriting a share's K/V
is idempotent; nothing has been sampled yet, so every RNG is where it was): the shares that
fail alone are marked failed, the others get exactly the tokens they would have got.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from minillm.cache.block_manager import BlockManager
from minillm.cache.paged import PagedKVCache
from minillm.engine.scheduler import Batch, Sampled, Scheduled
from minillm.engine.sequence import Sequence
from minillm.generation.loop import stop_ids
from minillm.generation.processors import token_logprobs
from minillm.generation.sampling import sample
from minillm.model.transformer import Transformer

log = logging.getLogger(__name__)


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

    def inputs(
        self, items: list[Scheduled]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[Scheduled, list[int]]]]:
        """(ids [1, N], positions [1, N], the rows that get logits, and for each share whose
        prompt logprobs are wanted, the positions whose logits give them).

        All the step's tokens in one row: each one-token item's token (a decode: the last
        sampled token, at position len - 1), then each chunk's tokens at their positions. The
        cache is told whose each token is (`plan`: the rows' block tables, in this order);
        where its K/V go follows from its position. Logit
        rows: first each sampled share's last token, then the prompt-logprob positions."""
        ids, positions, last, extra, wanted = [], [], [], [], []
        decode, prefill = [], []
        for item in items:
            seq, start, n = item.seq, item.start, item.num_tokens
            offset = len(ids)
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            if item.samplers:
                last.append(len(ids) - 1)
            if seq.needs_prompt_logprobs:  # position p's logits give token p + 1's logprob
                first = max(start, len(seq.prompt_logprobs))
                at = list(range(first, min(start + n, seq.num_prompt_tokens - 1)))
                extra += [offset + p - start for p in at]
                wanted.append((item, at))
            if n == 1:
                decode.append(seq.block_table)
            else:
                prefill.append((seq.block_table, n))
        self.cache.plan(decode, prefill)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor([ids]), as_tensor([positions]), as_tensor(last + extra), wanted

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[Sampled]:
        """Copy blocks (swap out, swap in, copy-on-write), run the forward, and sample one
        token per sampler, in the batch's order. Sequences that share prefix blocks may run
        together: every layer writes all tokens' K/V before any token reads. A failure is
        confined to its request (the module's docstring says how)."""
        self.cache.swap(batch.swap_out, out=True)
        self.cache.swap(batch.swap_in, out=False)
        self.cache.copy_blocks(batch.copies)
        try:
            return self._run(batch.items, fast=True)
        except Exception as err:  # whose fault? run the shares alone to see
            if len(batch.items) == 1:
                return self._failed(batch.items[0], err)
            log.warning("a batched forward failed (%r): its shares run one at a time", err)
        out = []
        for item in batch.items:
            try:
                out += self._run([item], fast=False)
            except Exception as err:  # this share's own failure
                out += self._failed(item, err)
        return out

    @staticmethod
    def _failed(item: Scheduled, err: Exception) -> list[Sampled]:
        """Mark a share failed: its sequences (and so its request) will be aborted."""
        log.error("request %s failed in the forward: %r", item.seq.request_id, err)
        item.error = f"{type(err).__name__}: {err}"
        return [Sampled(-1, error=item.error) for _ in item.samplers]

    def _run(self, items: list[Scheduled], fast: bool) -> list[Sampled]:
        """Forward `items`, record their prompt logprobs, sample their samplers."""
        samplers = [item.samplers for item in items if item.samplers]
        decode_only = all(item.num_tokens == 1 and item.samplers for item in items)
        static = self.decode_mode != "eager" and decode_only and len(items) <= self.buckets[-1]
        if fast and static:
            logits = self._static_decode(items)
            wanted = []
        else:
            ids, positions, rows, wanted = self.inputs(items)
            logits = self.model(ids, positions, cache=self.cache, logits_at=rows)[0]
        at = len(samplers)
        for item, positions in wanted:
            tokens = [item.seq.token_ids[p + 1] for p in positions]
            k = item.seq.params.prompt_logprobs
            item.prompt_logprobs = token_logprobs(logits[at : at + len(tokens)], tokens, k)
            at += len(tokens)
        return self.sample(logits[: len(samplers)].float(), samplers) if samplers else []

    def _static_decode(self, items: list[Scheduled]) -> torch.Tensor:
        """A decode-only step padded to its bucket, replayed from the bucket's recording.
        With the Triton kernel the block tables are as wide as the context (the kernel
        reads only each row's length); the gather path reads every column, so its width is
        bucketed too (powers of two) and each (rows, width) pair has its own recording."""
        n = len(items)
        rows = next(b for b in self.buckets if b >= n)
        width = self.max_blocks
        if not self.cache.use_kernel:
            need = max(len(item.seq.block_table) for item in items)
            width = min(self.max_blocks, 1 << (need - 1).bit_length())
        self.cache.plan_static_decode([item.seq.block_table for item in items], rows, width)
        tokens = [item.seq.token_ids[item.start] for item in items]
        step_ids = torch.tensor([tokens + [0] * (rows - n)])
        step_positions = torch.tensor([[item.start for item in items] + [0] * (rows - n)])
        if (rows, width) not in self.graphs:  # recording runs the step: on this step's inputs
            self.graphs[rows, width] = self._record(step_ids, step_positions)
        ids, positions, out, replay = self.graphs[rows, width]
        ids.copy_(step_ids)
        positions.copy_(step_positions)
        replay()
        return out[0, :n]

    def _record(self, first_ids: torch.Tensor, first_positions: torch.Tensor) -> tuple:
        """Fixed input buffers for a bucket, holding the first step's inputs (recording runs
        the step, and its K/V writes land where that step's tokens go), and a function that
        runs the step on them: a CUDA graph's replay, a compiled step, or the eager step."""
        ids, positions = first_ids.to(self.device), first_positions.to(self.device)
        rows = torch.arange(ids.shape[1], device=self.device)

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

    def sample(self, logits: torch.Tensor, samplers: list[list[Sequence]]) -> list[Sampled]:
        """One token per sampling sequence: row r's logits serve every sequence in
        samplers[r] (the children of a request with n > 1 share their parent's row). Each
        draws from its own params, history and seeded RNG, so a sequence gets the same
        tokens alone or in any batch; an all-plain-greedy step takes one argmax on the
        device. A sequence whose draw raises fails alone. Logprobs come from the same row."""
        seqs = [(r, s) for r, group in enumerate(samplers) for s in group]
        if all(s.params.greedy and not s.params.adjusts_logits for _, s in seqs):
            best = logits.argmax(dim=-1).tolist()
            draws = [Sampled(best[r]) for r, _ in seqs]
        else:
            rows, draws = logits.cpu(), []  # the sequences' RNGs are CPU generators
            for r, s in seqs:
                draws.append(self._draw(rows[r], s))
        for (r, s), draw in zip(seqs, draws, strict=True):
            if s.params.needs_logprobs and draw.error is None:
                try:
                    k = s.params.logprobs or 0
                    draw.logprobs = token_logprobs(logits[r : r + 1], [draw.token], k)[0]
                except Exception as err:  # kept to this sequence
                    draw.error = f"{type(err).__name__}: {err}"
        return draws

    def _draw(self, row: torch.Tensor, seq: Sequence) -> Sampled:
        try:
            history = [seq.history(stop_ids(self.model, seq.params))]
            return Sampled(int(sample(row[None], seq.params, seq.generator, history)))
        except Exception as err:  # one sequence's failure, kept to it
            log.exception("sampling failed for request %s", seq.request_id)
            return Sampled(-1, error=f"{type(err).__name__}: {err}")
