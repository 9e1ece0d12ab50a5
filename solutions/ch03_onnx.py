"""Chapter 03 answers: the three functions rewritten so that the ONNX exporter takes them.

Written from scratch in plain torch (no minillm import); the tests export each one with
`torch.onnx.export(..., dynamo=True)` and compare ONNX Runtime's output with PyTorch's.
"""

from __future__ import annotations

import torch


def clip_by_max_norm(x: torch.Tensor, max_abs: float) -> torch.Tensor:
    """Scale x down so that its largest |value| is at most `max_abs`; else leave it."""
    peak = x.abs().max()  # not .amax(): with no dim it has no translation (onnxscript 0.7)
    # Both branches as tensors, the choice made per element by `where`: no Python `if`
    # on a tensor's value, so the graph holds both and picks at run time.
    scale = torch.where(peak > max_abs, max_abs / peak.clamp_min(1e-30), torch.ones_like(peak))
    return x * scale


def lower_median(x: torch.Tensor) -> torch.Tensor:
    """torch.median(x, dim=-1).values (the lower median), from sort and gather."""
    n = x.shape[-1]
    ordered = x.sort(dim=-1).values  # Sort has an ONNX translation (TopK); median has none
    index = torch.full((*x.shape[:-1], 1), (n - 1) // 2, dtype=torch.long, device=x.device)
    return ordered.gather(-1, index).squeeze(-1)


def padded_causal_mask(attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """bool [B, 1, T, S]: causal over slots, padding hidden, each query sees itself."""
    S = attention_mask.shape[1]
    slots = torch.arange(S, device=attention_mask.device)
    queries = slots[S - query_len :]  # the last T slots hold the queries
    causal = slots[None, :] <= queries[:, None]  # [T, S]
    real = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    # No `if attention_mask.all()` fast path: that branch reads data and cannot export.
    return (causal & real) | (slots[None, :] == queries[:, None])
