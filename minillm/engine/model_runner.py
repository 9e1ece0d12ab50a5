"""Turn a scheduled batch into one forward of the model on the paged KV cache, and
sample each sequence's next token with its own parameters and RNG."""

from __future__ import annotations

import torch

from minillm.cache.block_manager import BlockManager
from minillm.cache.paged import PagedKVCache
from minillm.engine.scheduler import Batch
from minillm.engine.sequence import Sequence
from minillm.generation.sampling import sample
from minillm.model.transformer import Transformer


class ModelRunner:
    """Owns the K/V pool; `run(batch)` returns each sequence's last-position logits."""

    def __init__(self, model: Transformer, manager: BlockManager, use_kernel: bool = False) -> None:
        self.model, self.manager = model, manager
        self.device = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype
        self.cache = PagedKVCache(
            model.config, manager.num_blocks, manager.block_size, dtype, self.device, use_kernel
        )

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [B, T], positions [B, T], index of each row's last real token [B]).

        Prefill rows hold the tokens past each sequence's prefix-cache hit, right-padded;
        a padding token's position continues its row, so its K/V lands either past the
        row's blocks (dropped by the cache) or in its own last block's unused slots, which
        the next real token overwrites before anyone reads them. Decode rows hold the last
        sampled token at position len - 1 (its slot was reserved by the scheduler).
        """
        if not batch.is_prefill:
            ids = [[s.output_ids[-1]] for s in batch.seqs]
            pos = [[len(s) - 1] for s in batch.seqs]
            last = [0] * len(batch.seqs)
        else:
            rows = [s.token_ids[s.num_cached :] for s in batch.seqs]
            width = max(len(r) for r in rows)
            ids = [r + [0] * (width - len(r)) for r in rows]
            pos = [list(range(s.num_cached, s.num_cached + width)) for s in batch.seqs]
            last = [len(r) - 1 for r in rows]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), as_tensor(last)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [B, vocab] at each sequence's last token. Sequences that share prefix
        blocks may prefill together: every layer writes all rows' K/V before any row
        reads, so a row reusing another row's fresh blocks sees them filled."""
        self.cache.copy_blocks(batch.copies)
        self.cache.set_tables([self.manager.block_table(s.seq_id) for s in batch.seqs])
        ids, pos, last = self.inputs(batch)
        logits = self.model(ids, pos, cache=self.cache)
        return logits[torch.arange(len(batch.seqs), device=self.device), last].float()

    @staticmethod
    def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row, each from its own params and seeded RNG, so a sequence draws
        the same tokens alone or in any batch."""
        out, logits = [], logits.cpu()  # the sequences' RNGs are CPU generators
        for row, seq in zip(logits, seqs, strict=True):
            out.append(int(sample(row[None], seq.params, seq.generator)))
        return out
