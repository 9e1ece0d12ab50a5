"""How many KV blocks fit: vLLM's `gpu_memory_utilization`, implemented.

vLLM does not ask for a number of blocks. It is given a fraction of the device's memory and
works the pool out from what is left once the model is in and one worst-case step has run:

    pool bytes = total memory x gpu_memory_utilization - weights - peak activations
    blocks     = pool bytes // bytes per block

The worst-case step is a forward of `max_num_batched_tokens` tokens (the scheduler never
puts more in one step), so its peak is the most activation memory a step will need. The
engine does the same on a GPU (`profile_cuda`: one dummy forward, the allocator's peak).
Not counted, as in vLLM's simpler versions: the CUDA context (a few hundred MiB outside
torch's allocator) and the memory the decode steps' CUDA graphs keep once recorded; a
fraction below 1 leaves room for both.

A CPU has no allocator peak to read and shares its memory with everything else on the
machine, so the rule there is documented instead of profiled (`cpu_pool_bytes`): the same
fraction of the memory *available now* (the weights are already loaded, so already
excluded), capped at `CPU_POOL_CAP` so that a laptop is not filled, and never more blocks
than every running sequence can fill at full context (more would only hold prefix-cache
entries). `num_blocks` given to the engine overrides all of it, as vLLM's
`num_gpu_blocks_override` does.

Everything but the two readers of the machine (`profile_cuda`, `cpu_pool_bytes`) is pure
arithmetic, tested with made-up numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.cache.kv_quant import kv_quant
from minillm.cache.protocol import ModelShape

CPU_POOL_CAP = 2 * 2**30  # bytes: the most a CPU engine's KV pool takes by default
SWAP_SPACE = 4 * 2**30  # bytes: the CPU swap pool's cap when the pool is sized from memory


def kv_bytes_per_block(
    cfg: ModelShape, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one block of the paged pool takes: K and V of `block_size` tokens in every
    layer and kv head. A quantized cache (`kv_cache_dtype` int8/fp8) stores 1-byte codes
    plus one fp32 scale per token and head, so it is not simply half of bf16."""
    quant = kv_quant(kv_cache_dtype)
    head_dim = int(cfg.head_dim or 0)
    per_vector = head_dim * dtype.itemsize if quant is None else quant.bytes_per_vector(head_dim)
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * per_vector


@dataclass(frozen=True)
class PoolPlan:
    """The arithmetic behind a pool size, every term in bytes, for printing and checking."""

    device: str  # "cuda" or "cpu"
    budget: int  # cuda: total x utilization; cpu: min(available x utilization, cap)
    weights: int  # the model's parameters (cuda: subtracted; cpu: already not available)
    activations: int  # cuda: peak of the profiled forward above what was allocated before it
    other: int  # cuda: what else this process held before profiling (other engines, ...)
    bytes_per_block: int
    blocks: int  # after the cap below
    cap_blocks: int | None = None  # cpu: max_num_seqs x blocks of a full context

    @property
    def pool_bytes(self) -> int:
        return self.blocks * self.bytes_per_block

    def describe(self) -> str:
        """The sum, in GiB, one line per term."""
        gib = 2**30
        if self.device == "cuda":
            left = self.budget - self.weights - self.activations - self.other
            terms = [
                f"budget (total x gpu_memory_utilization) {self.budget / gib:8.2f} GiB",
                f"- weights                                {self.weights / gib:8.2f} GiB",
                f"- peak activations of the profile step  {self.activations / gib:8.2f} GiB",
                f"- other tensors of this process          {self.other / gib:8.2f} GiB",
                f"= for the KV cache                       {left / gib:8.2f} GiB",
            ]
        else:
            terms = [f"budget (available RAM x fraction, capped) {self.budget / gib:.2f} GiB"]
        terms.append(
            f"/ {self.bytes_per_block:,} bytes a block = {self.blocks:,} blocks"
            + (f" (capped at {self.cap_blocks:,})" if self.cap_blocks is not None else "")
        )
        return "\n".join(terms)


def plan_gpu_pool(
    total: int,
    utilization: float,
    weights: int,
    activations: int,
    bytes_per_block: int,
    other: int = 0,
) -> PoolPlan:
    """vLLM's rule: (total x utilization - weights - activations - other) // block bytes.
    Raises ValueError naming the fixes when not one block fits."""
    budget = int(total * utilization)
    left = budget - weights - activations - other
    blocks = max(left, 0) // bytes_per_block - 1  # the cache keeps one block for padding
    if blocks < 1:
        gib = 2**30
        raise ValueError(
            f"no KV block fits: gpu_memory_utilization={utilization} of {total / gib:.1f} GiB "
            f"is {budget / gib:.2f} GiB, and the weights ({weights / gib:.2f} GiB), the peak "
            f"activations of a max_num_batched_tokens step ({activations / gib:.2f} GiB) and "
            f"other tensors ({other / gib:.2f} GiB) leave {left / gib:.2f} GiB for blocks of "
            f"{bytes_per_block:,} bytes: raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, use a smaller kv_cache_dtype, or pass num_blocks"
        )
    return PoolPlan("cuda", budget, weights, activations, other, bytes_per_block, blocks)


def plan_cpu_pool(
    available: int,
    utilization: float,
    bytes_per_block: int,
    cap_blocks: int,
    weights: int = 0,
    cap_bytes: int = CPU_POOL_CAP,
) -> PoolPlan:
    """The CPU rule: min(available x utilization, cap_bytes) // block bytes, and at most
    `cap_blocks`. Raises ValueError naming the fixes when not one block fits."""
    budget = min(int(available * utilization), cap_bytes)
    blocks = min(budget // bytes_per_block, cap_blocks)
    if blocks < 1:
        raise ValueError(
            f"no KV block fits: {utilization} of the {available / 2**20:.0f} MiB of RAM "
            f"available is less than one block ({bytes_per_block:,} bytes): free some memory, "
            "raise gpu_memory_utilization, or pass num_blocks"
        )
    return PoolPlan("cpu", budget, weights, 0, 0, bytes_per_block, blocks, cap_blocks)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (a tied lm_head is counted once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.inference_mode()
def profile_cuda(model: torch.nn.Module, num_tokens: int, logit_rows: int) -> tuple[int, int, int]:
    """(total device memory, other tensors, peak activations) in bytes, after one dummy
    forward of `num_tokens` tokens, as vLLM profiles: rows of at most the model's context,
    logits for `logit_rows` positions (an engine step samples one row per sequence), no KV
    cache (the pool does not exist yet; its bytes are what this sizes)."""
    device = model.lm_head.weight.device
    context = model.config.max_position_embeddings
    rows, width = -(-num_tokens // context), min(num_tokens, context)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    at = torch.arange(max(width - logit_rows, 0), width, device=device)
    model(ids, logits_at=at)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    return total, before - weight_bytes(model), peak


def pool_blocks(
    model: torch.nn.Module,
    num_blocks: int | None,
    utilization: float | None,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_dtype: str = "auto",
) -> tuple[int, PoolPlan | None]:
    """The engine's pool size and, when it was worked out from memory, how: `num_blocks`
    when given; else from `utilization` (`size_pool`); else (neither given) enough for
    every running sequence to reach the full context."""
    if num_blocks is not None:
        return num_blocks, None
    if utilization is None:
        return max_num_seqs * -(-model.config.max_position_embeddings // block_size), None
    plan = size_pool(
        model, utilization, block_size, max_num_seqs, max_num_batched_tokens, kv_cache_dtype
    )
    return plan.blocks, plan


def cpu_available_bytes() -> int:
    """RAM the operating system could give this process now without swapping."""
    import psutil

    return int(psutil.virtual_memory().available)


def size_pool(
    model: torch.nn.Module,
    utilization: float,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_dtype: str = "auto",
) -> PoolPlan:
    """The pool for this model on its device: profiled on CUDA, the CPU rule elsewhere."""
    cfg = model.config
    dtype = model.lm_head.weight.dtype
    per_block = kv_bytes_per_block(cfg, block_size, dtype, kv_cache_dtype)
    weights = weight_bytes(model)
    if model.lm_head.weight.is_cuda:
        total, other, peak = profile_cuda(model, max_num_batched_tokens, max_num_seqs)
        return plan_gpu_pool(total, utilization, weights, peak, per_block, max(other, 0))
    full = max_num_seqs * -(-cfg.max_position_embeddings // block_size)
    return plan_cpu_pool(cpu_available_bytes(), utilization, per_block, full, weights)
