"""Generation on the paged cache (chapter 07): prompts sharing prefix blocks prefill
them once, and the n samples of a prompt share its blocks until they diverge."""

from __future__ import annotations

import torch

from minillm.cache.block_manager import BlockManager, PagedSequence
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
    """Like `minillm.generate`, on a paged cache: prompts sharing prefix blocks prefill them
    once, and each prompt's `n` samples share its blocks (forks). Returns len(prompts) * n
    lists, the samples of each prompt together. No preemption: an OutOfBlocks here means
    `num_blocks` is too small for the batch. A `manager` given may have a warm prefix cache
    (later calls then hit it). `use_kernel`: decode rows attend with the Triton paged kernel."""
    cfg, device = model.config, model.lm_head.weight.device
    for p in prompts:
        check_length(model, len(p), params.max_tokens)
    if num_blocks is None:  # enough for every sample without sharing
        num_blocks = (
            len(prompts) * n * -(-(len(max(prompts, key=len)) + params.max_tokens) // block_size)
        )
    manager = manager or BlockManager(num_blocks, block_size)
    dtype = model.lm_head.weight.dtype
    cache = PagedKVCache(cfg, manager.num_blocks, manager.block_size, dtype, device, use_kernel)
    # Prefill one prompt after another, so that a later prompt finds an earlier one's blocks
    # in the prefix cache: only each prompt's uncached tail runs.
    seqs, last_logits = [], []
    for p in prompts:
        seq = PagedSequence(list(p))
        start = manager.allocate(seq)
        cache.plan(decode=[], chunks=[(seq.block_table, len(p) - start)])
        ids = torch.tensor([p[start:]], device=device)
        pos = torch.arange(start, len(p), device=device)[None]
        last_logits.append(model(ids, pos, cache=cache)[0, -1])
        manager.mark_computed(seq, len(p))
        seqs.append(seq)
        for _ in range(1, n):
            child = PagedSequence(list(p))
            manager.fork(seq, child)
            seqs.append(child)
    logits = torch.stack([last_logits[i // n] for i in range(len(seqs))])
    generators = [
        make_generator(None if params.seed is None else params.seed + i % n, device)
        for i in range(len(seqs))
    ]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        copies = []
        for seq, token in zip(seqs, tokens.tolist(), strict=True):
            seq.token_ids.append(token)
            copies += manager.append_slots(seq)  # a shared last block is copied first
        cache.copy_blocks(copies)
        cache.plan(decode=[s.block_table for s in seqs], chunks=[])
        positions = torch.tensor([[len(s) - 1 for s in seqs]], device=device)
        logits = model(tokens[None], positions, cache=cache)[0]
        for seq in seqs:
            manager.mark_computed(seq, len(seq))
        return logits

    rows = [list(prompts[i // n]) for i in range(len(seqs))]
    out = sample_loop(logits, params, step, stop_ids(model, params), generators, prompts=rows)
    for seq in seqs:
        manager.free(seq)
    return out
