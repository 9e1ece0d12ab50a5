"""Turn a scheduled batch into one `Step` for the worker(s) holding the model and the paged
KV cache (`worker.py`), and sample each sequence's next token from the logits that come
back with its own parameters and RNG: token ids in, token ids out.

Decode-only steps take the padded path unless `decode_mode="eager"` (`worker.py` says
why): the batch is padded to a bucket size (1, 2, 4, 8, 16, 32, ... up to max_num_seqs).

A failure is kept to the request that caused it. Each sequence draws its token on its own,
so a sampler that raises fails only its sequence. If the batched forward raises, the step's
shares are run again one at a time (the block copies are done, and rewriting a share's K/V
is idempotent; nothing has been sampled yet, so every RNG is where it was): the shares that
fail alone are marked failed, the others get exactly the tokens they would have got.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from minillm.cache.block_manager import BlockManager
from minillm.engine.scheduler import Batch, Sampled, Scheduled
from minillm.engine.sequence import Sequence
from minillm.engine.worker import Executor, Pairs, Step
from minillm.generation.loop import stop_ids
from minillm.generation.processors import token_logprobs
from minillm.generation.sampling import sample
from minillm.model.transformer import Transformer

log = logging.getLogger(__name__)


class ModelRunner:
    """Builds each step and samples its tokens; `worker` (one `Worker`, or every rank's
    through `minillm.engine.parallel`) holds the model and the K/V pool and runs it, up to
    `worker.depth` steps at once (a pipeline's stages)."""

    def __init__(
        self, model: Transformer, manager: BlockManager, worker: Executor, max_batch: int = 32
    ) -> None:
        self.model, self.manager, self.worker = model, manager, worker
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch]
        self.buckets.append(max_batch)
        self.max_blocks = manager.blocks_for(model.config.max_position_embeddings)

    def inputs(self, items: list[Scheduled]) -> tuple[Step, list[tuple[Scheduled, list[int]]]]:
        """The step of `items`, and for each share whose prompt logprobs are wanted, the
        positions whose logits give them.

        All the step's tokens in one row: each one-token item's token (a decode: the last
        sampled token, at position len - 1), then each chunk's tokens at their positions,
        each with its row's block table (where its K/V go follows from its position). Logit
        rows: first each sampled share's last token, then the prompt-logprob positions."""
        step, last, extra, wanted = Step([], [], [], []), [], [], []
        for item in items:
            seq, start, n = item.seq, item.start, item.num_tokens
            offset = len(step.ids)
            step.ids += seq.token_ids[start : start + n]
            step.positions += range(start, start + n)
            if item.samplers:
                last.append(len(step.ids) - 1)
            if seq.needs_prompt_logprobs:  # position p's logits give token p + 1's logprob
                first = max(start, len(seq.prompt_logprobs))
                at = list(range(first, min(start + n, seq.num_prompt_tokens - 1)))
                extra += [offset + p - start for p in at]
                wanted.append((item, at))
            if n == 1:
                step.decode.append(seq.block_table)
            else:
                step.prefill.append((seq.block_table, n))
        step.rows = last + extra
        return step, wanted

    def run(self, batch: Batch) -> list[Sampled]:
        """`submit(batch)()`: the step's tokens."""
        return self.submit(batch)()

    def submit(self, batch: Batch) -> Callable[[], list[Sampled]]:
        """Start the step: copy blocks (swap out, swap in, copy-on-write), start the forward.
        Calling what comes back waits for it and samples one token per sampler, in the
        batch's order. Sequences that share prefix blocks may run together: every layer
        writes all tokens' K/V before any token reads. A failure is confined to its request
        (the module's docstring says how)."""
        moves = {"swap_out": batch.swap_out, "swap_in": batch.swap_in, "copies": batch.copies}
        try:
            started = self._start(batch.items, fast=True, moves=moves)
        except Exception as err:  # raised when the tokens are asked for
            started = _raise(err)
        return lambda: self._finish(batch.items, started)

    @torch.inference_mode()
    def _finish(
        self, items: list[Scheduled], started: Callable[[], list[Sampled]]
    ) -> list[Sampled]:
        try:
            return started()
        except Exception as err:  # whose fault? run the shares alone to see
            if len(items) == 1:
                return self._failed(items[0], err)
            log.warning("a batched forward failed (%r): its shares run one at a time", err)
        out = []
        for item in items:
            try:
                out += self._start([item], fast=False)()
            except Exception as err:  # this share's own failure
                out += self._failed(item, err)
        return out

    @staticmethod
    def _failed(item: Scheduled, err: Exception) -> list[Sampled]:
        """Mark a share failed: its sequences (and so its request) will be aborted."""
        log.error("request %s failed in the forward: %r", item.seq.request_id, err)
        item.error = f"{type(err).__name__}: {err}"
        return [Sampled(-1, error=item.error) for _ in item.samplers]

    def _start(
        self, items: list[Scheduled], fast: bool, moves: dict[str, Pairs] | None = None
    ) -> Callable[[], list[Sampled]]:
        """Start the forward of `items` (after the block `moves`); what comes back waits for
        it, records their prompt logprobs and samples their samplers."""
        samplers = [item.samplers for item in items if item.samplers]
        decode_only = bool(items) and all(i.num_tokens == 1 and i.samplers for i in items)
        padded = self.worker.decode_mode != "eager" and decode_only
        if fast and padded and len(items) <= self.buckets[-1]:
            step, wanted = self._padded(items), []
        else:
            step, wanted = self.inputs(items)
        logits = self.worker.submit(replace(step, **(moves or {})))
        return lambda: self._sample_step(logits(), samplers, wanted)

    @torch.inference_mode()
    def _sample_step(
        self,
        logits: torch.Tensor,
        samplers: list[list[Sequence]],
        wanted: list[tuple[Scheduled, list[int]]],
    ) -> list[Sampled]:
        at = len(samplers)
        for item, positions in wanted:
            tokens = [item.seq.token_ids[p + 1] for p in positions]
            k = item.seq.params.prompt_logprobs
            item.prompt_logprobs = token_logprobs(logits[at : at + len(tokens)], tokens, k)
            at += len(tokens)
        return self.sample(logits[: len(samplers)].float(), samplers) if samplers else []

    def _padded(self, items: list[Scheduled]) -> Step:
        """A decode-only step padded to its bucket. With the Triton kernel the block tables
        are as wide as the context (the kernel reads only each row's length); the gather
        path reads every column, so its width is bucketed too (powers of two) and each
        (rows, width) pair has its own recording."""
        n = len(items)
        rows = next(b for b in self.buckets if b >= n)
        width = self.max_blocks
        if not self.worker.cache.use_kernel:
            need = max(len(item.seq.block_table) for item in items)
            width = min(self.max_blocks, 1 << (need - 1).bit_length())
        tokens = [item.seq.token_ids[item.start] for item in items]
        positions = [item.start for item in items]
        tables = [item.seq.block_table for item in items]
        pad = [0] * (rows - n)
        return Step(tokens + pad, positions + pad, list(range(n)), tables, bucket=(rows, width))

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


def _raise(err: Exception) -> Callable[[], list[Sampled]]:
    """A step that failed to start: asking for its tokens raises its error."""

    def fail() -> list[Sampled]:
        raise err

    return fail
