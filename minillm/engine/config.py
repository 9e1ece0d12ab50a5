"""`EngineConfig`: every setting of the engine in one place, checked once when it is made.

`LLM(...)`, `python -m minillm serve` and the benchmarks build one and hand it to the
`Engine`, so a setting has one name, one default and one check wherever it is given, and
the scheduler, the model runner and the pool sizing read it as it is. The names are vLLM's
where vLLM has the setting (`max_num_seqs`, `max_num_batched_tokens`, `block_size`,
`gpu_memory_utilization`, `kv_cache_dtype`, `max_logprobs`, `seed`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from minillm.cache.kv_quant import KV_CACHE_DTYPES

DECODE_MODES = ("eager", "static", "compile", "cuda_graph")
PREEMPTION_MODES = ("recompute", "swap")
VLLM_NAMES = {"num_gpu_blocks_override": "num_blocks", "enable_prefix_caching": "prefix_cache"}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and decodes. None means "work it out": the pool's
    size from memory or the context, the kernel and decode mode from the device."""

    num_blocks: int | None = None  # KV blocks in the pool (None: gpu_memory_utilization or
    # enough for every running sequence at full context, `engine/memory.py`)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 32  # sequences running at once (a request counts n times)
    max_num_batched_tokens: int = 2048  # the token budget of one step
    prefix_cache: bool = True  # reuse the KV blocks of a prompt prefix already computed
    chunked_prefill: bool = True  # decodes and prompt chunks share each step (vLLM V1)
    static: bool = False  # the static-batching baseline: admit only when nothing runs
    preemption_mode: str = "recompute"  # or "swap" (to the CPU pool)
    num_swap_blocks: int | None = None  # the CPU pool (None: as large as the pool, for swap)
    use_kernel: bool | None = None  # Triton paged decode (None: on a GPU, unquantized K/V)
    decode_mode: str | None = None  # DECODE_MODES (None: cuda_graph on a GPU, else eager)
    kv_cache_dtype: str = "auto"  # the model's dtype, or int8 / fp8 codes with scales
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    gpu_memory_utilization: float | None = None  # size the pool from this share of memory
    seed: int | None = None  # unseeded requests draw their seeds from it, in arrival order

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        need(self.num_blocks is None or self.num_blocks >= 1, "num_blocks must be >= 1")
        need(self.num_swap_blocks is None or self.num_swap_blocks >= 0, "num_swap_blocks < 0")
        need(self.max_logprobs >= 0, f"max_logprobs={self.max_logprobs} must be >= 0")
        need(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode={self.preemption_mode!r}: use 'recompute' or 'swap'",
        )
        need(
            self.decode_mode is None or self.decode_mode in DECODE_MODES,
            f"decode_mode={self.decode_mode!r}: use one of {DECODE_MODES} (or None)",
        )
        need(
            self.kv_cache_dtype == "auto" or self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype={self.kv_cache_dtype!r}: use 'auto' (the model's dtype) or one "
            f"of {', '.join(KV_CACHE_DTYPES)}",
        )
        utilization = self.gpu_memory_utilization
        need(
            utilization is None or 0 < utilization <= 1,
            f"gpu_memory_utilization={utilization}: a fraction of memory, in (0, 1] "
            "(vLLM's default is 0.9)",
        )

    @classmethod
    def of(cls, **settings: Any) -> EngineConfig:
        """A config from keyword settings, vLLM's names for them accepted
        (`num_gpu_blocks_override`, `enable_prefix_caching`); an unknown name is refused
        with the list of known ones, instead of a bare TypeError."""
        for vllm, ours in VLLM_NAMES.items():
            if vllm in settings:
                settings[ours] = settings.pop(vllm)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(
                f"unknown engine setting(s) {unknown}: the engine takes {', '.join(sorted(known))}"
            )
        return cls(**settings)
