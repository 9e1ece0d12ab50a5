"""Turn a scheduled batch into one forward of the model on the paged KV cache, and sample
each sequence's next token with its own parameters and RNG: token ids in, token ids out."""

from __future__ import annotations

import torch

from minillm.cache.block_manager import BlockManager
from minillm.cache.paged import PagedKVCache
from minillm.engine.scheduler import Batch
from minillm.generation.sampling import sample
from minillm.model.transformer import Transformer


class ModelRunner:
    """Owns the K/V pool (and its CPU swap pool); `run(batch)` returns the sampled tokens."""

    def __init__(
        self,
        model: Transformer,
        manager: BlockManager,
        use_kernel: bool = False,
        num_swap_blocks: int = 0,
    ) -> None:
        self.model, self.manager = model, manager
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
        ids, positions, last = self.inputs(batch)
        logits = self.model(ids, positions, cache=self.cache, logits_at=last)[0].float()
        samplers = [item.samplers for item in batch.items if item.samplers]
        return self.sample(logits, samplers) if samplers else []  # [] : chunks mid-prompt

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
