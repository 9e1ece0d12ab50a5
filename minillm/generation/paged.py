"""Generation on the paged cache (chapter 07): prompts sharing prefix blocks prefill
them once, and the n samples of a prompt share its blocks until they diverge."""

from __future__ import annotations

import torch

from minillm.cache.block_manager import BlockManager
from minillm.cache.paged import PagedKVCache
from minillm.generation.loop import check_length, sample_loop, stop_ids
from minillm.generation.sampling import SamplingParams, make_generator
from minillm.model.transformer import Transformer


@torch.inference_mode()
def generate_paged(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    block_size: int = 16,
    num_blocks: int | None = None,
    n: int = 1,
    manager: BlockManager | None = None,
    use_kernel: bool = False,
) -> list[list[int]]:
    """Like `minillm.generation.cached`, on a paged cache: prompts sharing prefix blocks prefill
    them once, and each prompt's `n` samples share its blocks (forks). Returns
    len(prompts) * n lists, the samples of each prompt together. No preemption: an
    OutOfBlocks here means `num_blocks` is too small for the batch. A `manager` given must
    hold no sequences (its prefix cache may be warm: later calls then hit it).
    `use_kernel`: decode steps attend with the Triton paged kernel (see PagedKVCache)."""
    cfg, device = model.config, model.lm_head.weight.device
    limit = cfg.max_position_embeddings
    for p in prompts:
        check_length(model, len(p), params.max_tokens)
    if num_blocks is None:  # enough for every sample without sharing
        num_blocks = len(prompts) * n * -(-(limit + 1) // block_size)
    manager = manager or BlockManager(num_blocks, block_size)
    if manager.tables:
        raise ValueError("generate_paged needs a BlockManager without sequences: free them")
    dtype = model.lm_head.weight.dtype
    cache = PagedKVCache(cfg, manager.num_blocks, manager.block_size, dtype, device, use_kernel)
    # Prefill, one prompt after another so that a later prompt finds an earlier one's
    # blocks in the prefix cache; only each prompt's uncached tail runs.
    last_logits = []
    for i, p in enumerate(prompts):
        start = manager.allocate(i * n, p)
        cache.set_tables([manager.block_table(i * n)])
        ids = torch.tensor([p[start:]], device=device)
        pos = torch.arange(start, len(p), device=device)[None]
        last_logits.append(model(ids, pos, cache=cache)[0, -1])
        for j in range(1, n):
            manager.fork(i * n, i * n + j)
    seqs = list(range(len(prompts) * n))
    logits = torch.stack([last_logits[s // n] for s in seqs])
    positions = torch.tensor([len(prompts[s // n]) for s in seqs], device=device)
    generators = [
        make_generator(None if params.seed is None else params.seed + s % n, device) for s in seqs
    ]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal positions
        copies = []
        for s, token in enumerate(tokens.tolist()):  # each row's slot for this token
            copies += [c for c in [manager.append_slot(s, token)[1]] if c is not None]
        cache.copy_blocks(copies)
        cache.set_tables([manager.block_table(s) for s in seqs])
        logits = model(tokens[:, None], positions[:, None], cache=cache)[:, -1]
        positions = positions + 1
        return logits

    out = sample_loop(logits, params, step, stop_ids(model, params), generators)
    for s in seqs:
        manager.free(s)
    return out
