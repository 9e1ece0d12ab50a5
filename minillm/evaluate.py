"""Held-out perplexity: the quality number every later chapter compares against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minillm.model import Transformer


@torch.inference_mode()
def perplexity(model: Transformer, ids: torch.Tensor, window: int, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `window` tokens.

    Deterministic: the same ids always give the same windows; a short tail is dropped.
    """
    n = (len(ids) - 1) // window
    if n == 0:
        raise ValueError(f"need more than {window} tokens to score one window, got {len(ids)}")
    x = ids[: n * window].view(n, window)
    y = ids[1 : n * window + 1].view(n, window)
    device = model.lm_head.weight.device
    total = 0.0
    for i in range(0, n, batch_size):
        logits = model(x[i : i + batch_size].to(device)).float()
        target = y[i : i + batch_size].to(device)
        total += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
    return math.exp(total / (n * window))
