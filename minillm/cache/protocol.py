"""The one contract between the model and any KV cache, and what a cache needs of the model.

The model never asks which cache it has. In every layer it computes q, k, v for the new
tokens and calls `cache.attention(layer, q, k, v, positions)`: the cache stores k and v
wherever it keeps them and returns the attention of q over everything it holds for those
rows. The contiguous cache (chapter 02), the paged cache (chapter 07, with its Triton
kernel), the ONNX step graph's concatenating cache (chapter 03) and a learner's sliding
window cache (exercise 02) are all this one method.

A cache needs only the model's shapes (`ModelShape`, which `ModelConfig` satisfies), so
this layer sits below the model and imports nothing from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F


class ModelShape(Protocol):
    """The shape fields of a `minillm.model.ModelConfig` that size a cache."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int | None
    max_position_embeddings: int


class Cache(Protocol):
    """K/V storage the model attends through."""

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v [B, kv_heads, T, head_dim] of tokens at `positions` [B, T] and return
        the attention of q [B, heads, T, head_dim] over the row's cached tokens (each query
        sees the positions up to its own): [B, heads, T, head_dim]."""
        ...


# (q, k, v, mask) -> out: q [B, heads, T, d] over k, v [B, kv_heads, S, d], mask [B, 1, T, S]
SdpaFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """PyTorch's SDPA of q over the cached k, v with a boolean mask (True = attend).
    Grouped-query attention: each kv head serves heads / kv_heads query heads."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def grouped_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """`masked_sdpa` that reads each kv head's K/V once in a decode step (one query a row).

    With `enable_gqa`, PyTorch's CPU kernel attends head by head: each of a kv head's
    heads / kv_heads query heads streams that head's K and V again. Once a layer's K/V
    outgrow the core's L2 (SmolLM2: 3 kv heads x 64 x 4 bytes x 2 = 1.5 KiB a token, 1 MiB
    by ~700 tokens), every pass comes from L3 or memory. Folding a group's query heads into
    the rows of one head ([B, heads, 1, d] -> [B, kv_heads, group, d]: the same numbers,
    since query head h uses kv head h // group) makes it one pass over K and V per kv head;
    the decode mask [B, 1, 1, S] broadcasts over the folded rows. Prompt chunks (T > 1)
    reuse each K/V tile across their many query rows already: they take `masked_sdpa`."""
    batch, heads, t, d = q.shape
    kv_heads = k.shape[1]
    if t != 1 or heads == kv_heads:
        return masked_sdpa(q, k, v, mask)
    group = q.reshape(batch, kv_heads, heads // kv_heads, d)
    out = F.scaled_dot_product_attention(group, k, v, attn_mask=mask)
    return out.reshape(batch, heads, 1, d)


class SdpaCache(ABC):
    """A cache that attends the plain PyTorch way: `update` stores this step's K/V and
    returns all of the row's K/V, `causal_mask` says which of those slots each query may
    see, and `sdpa` does the rest. Subclasses write those two methods (a subclass missing
    one cannot be instantiated).

    `sdpa` is the extension point for the attention over the stored K/V: PyTorch's SDPA
    (`grouped_sdpa`) unless the cache instance is given its own, as an exporter does for
    the form it wants in the graph (`ConcatCache(..., sdpa=...)`, `ScatterCache(...,
    sdpa=...)`), for that cache only, where swapping torch's function would change every
    model in the process."""

    sdpa: SdpaFn = staticmethod(grouped_sdpa)

    @abstractmethod
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, head_dim] at `positions`; return the row's K/V."""

    @abstractmethod
    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, S] bool: which cached slots each query at `positions` may see."""

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        # The mask first: it describes what the cache held before this step's writes.
        mask = self.causal_mask(positions)  # [B, 1, T, S]: True = attend
        k_all, v_all = self.update(layer, k, v, positions)
        return self.sdpa(q, k_all, v_all, mask)
