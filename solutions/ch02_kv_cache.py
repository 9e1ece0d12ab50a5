"""Chapter 02 reference answers: same API and docstrings' contract as
`exercises/ch02_kv_cache.py`, written in plain torch (read the docstrings there).

The tests compare these with `minillm.model.Transformer` run without a cache (and with an
explicit mask), and with `minillm.cache.contiguous.KVCache`, so nothing here imports minillm.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F


def kv_cache_bytes(config: dict[str, Any], tokens: int, batch: int, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x tokens x batch x bytes per element."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads  # absent: multi-head attention
    head_dim = config.get("head_dim") or config["hidden_size"] // heads  # may differ from h/heads
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype.itemsize
    return per_token * tokens * batch


def cache_update(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Write k, v [B, KV, T, d] into one layer's buffers [B, KV, max_len, d], in place, token
    t of row b at slot positions[b, t]."""
    rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1], broadcast to [B, T]
    # Indexing dims 0 and 2 with [B, T] index tensors selects [B, T, KV, d]: the indexed
    # dims come first, so k's heads and tokens trade places to match.
    cache_k[rows, :, positions] = k.transpose(1, 2).to(cache_k.dtype)
    cache_v[rows, :, positions] = v.transpose(1, 2).to(cache_v.dtype)


def decode_step(
    model: Any, cache: Any, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Logits [B, vocab] of one new token per row (tokens, positions [B]) with a KV cache."""
    cache.kv_len = int(positions.max()) + 1  # the longest row's slots, this token's included
    with torch.inference_mode():
        logits = model(tokens[:, None], positions[:, None], cache=cache)  # [B, 1, vocab]
    return logits[:, -1]


class SlidingWindowCache:
    """Per-layer ring buffers of the last `window` tokens' K and V, for `batch` sequences."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        window: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        """Allocate K and V [num_layers, batch, kv_heads, window, head_dim], nothing more."""
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        shape = (num_layers, batch, kv_heads, window, head_dim)
        self.window = window
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # The position each slot holds, per row (-1: empty). Shared by all layers.
        self.slot_pos = torch.full((batch, window), -1, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V: 2 x layers x batch x kv_heads x window x head_dim x dtype size."""
        return self.k.nbytes + self.v.nbytes

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The cache protocol the model calls in every layer (`minillm.cache.protocol.Cache`),
        written for you: the mask first (it describes the ring as it was before this step),
        then the update, then attention over the S keys it returned."""
        mask = self.causal_mask(positions)
        k_all, v_all = self.update(layer, k, v, positions)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, window + T]: keys are the ring as it was, then this step's tokens."""
        query = positions[:, :, None]  # [B, T, 1]
        lowest = query - self.window + 1  # the oldest position a query may see
        old = self.slot_pos[:, None, :]  # [B, 1, W], -1 for an empty slot
        see_old = (old >= 0) & (old >= lowest) & (old <= query)
        new = positions[:, None, :]  # [B, 1, T]
        see_new = (new >= lowest) & (new <= query)  # causal inside the step, within the band
        return torch.cat([see_old, see_new], dim=-1)[:, None]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return [ring before this step, k] (and v) along the sequence axis, then store the
        step's last `window` tokens at slots position % window."""
        # Read before writing: a long step would overwrite keys its own early queries need.
        k_all = torch.cat([self.k[layer], k.to(self.k.dtype)], dim=2)
        v_all = torch.cat([self.v[layer], v.to(self.v.dtype)], dim=2)
        keep = positions[:, -self.window :]  # older tokens of the step are out of every window
        slots = keep % self.window
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.k[layer][rows, :, slots] = k[:, :, -self.window :].transpose(1, 2).to(self.k.dtype)
        self.v[layer][rows, :, slots] = v[:, :, -self.window :].transpose(1, 2).to(self.v.dtype)
        if layer == self.k.shape[0] - 1:  # the mask of the next step reads this, once per step
            self.slot_pos[rows, slots] = keep
        return k_all, v_all


def fork_cache(cache: Any, parent_rows: list[int] | torch.Tensor) -> Any:
    """A new cache whose row i is a copy of row parent_rows[i] of `cache`; `cache` unchanged."""
    batch = cache.k.shape[1]
    idx = torch.as_tensor(parent_rows, dtype=torch.long, device=cache.k.device).reshape(-1)
    if idx.numel() == 0 or idx.min() < 0 or idx.max() >= batch:
        raise ValueError(f"parent_rows must be non-empty row indices in 0..{batch - 1}: {idx}")
    forked = copy.copy(cache)  # the same class and every other attribute (kv_len, ...)
    # index_select copies: each new row owns its memory, so the rows diverge safely.
    forked.k = cache.k.index_select(1, idx)  # batch is dim 1: [layers, batch, ...]
    forked.v = cache.v.index_select(1, idx)
    return forked
