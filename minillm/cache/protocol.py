"""What the model needs from a KV cache, and what a cache needs to know of the model.

The model never asks which cache it has: it calls the methods of `Cache` and nothing else.
A cache in turn needs only the model's shapes (`ModelShape`, which `ModelConfig`
satisfies), so this layer sits below the model and imports nothing from it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ModelShape(Protocol):
    """The shape fields of a `minillm.model.config.ModelConfig` that size a cache."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int | None
    max_position_embeddings: int


class Cache(Protocol):
    """K/V storage the model writes each step's keys and values into and attends over."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, head_dim] at `positions` [B, T]; return the layer's
        K and V to attend over [B, kv_heads, S, head_dim]."""
        ...

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, S]: which of the S slots each query may attend to."""
        ...
