"""Chapter 05 answers: a decode step that torch.compile captures once.

Written from scratch in plain torch (no minillm), so the tests can compare it with
minillm's own static step (`minillm/generation/static.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def static_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Write k, v into one layer's fixed-size cache at `positions`, attend over every slot."""
    rows = torch.arange(q.shape[0], device=q.device)[:, None]  # [B, 1] against [B, T]
    # Scatter at tensor positions: a new position is new data, never a new guard.
    k_cache[rows, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[rows, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
    # All max_len slots, every step: the shape never changes; the mask hides the empty ones.
    slots = torch.arange(k_cache.shape[2], device=q.device)
    mask = (slots <= positions[..., None])[:, None]  # [B, 1, T, max_len]
    return F.scaled_dot_product_attention(
        q, k_cache.to(q.dtype), v_cache.to(q.dtype), attn_mask=mask, enable_gqa=True
    )
