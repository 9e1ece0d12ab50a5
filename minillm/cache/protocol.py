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


class SdpaCache(ABC):
    """A cache that attends the plain PyTorch way: `update` stores this step's K/V and
    returns all of the row's K/V, `causal_mask` says which of those slots each query may
    see, and SDPA does the rest. Subclasses write those two methods (a subclass missing
    one cannot be instantiated)."""

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
        # Grouped-query attention: each kv head serves heads / kv_heads query heads.
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
