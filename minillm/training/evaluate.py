"""Held-out quality: the numbers every later chapter (ONNX, quantization, ...) compares against.

Both functions take any `logits_fn(ids) -> logits` (a minillm model, a quantized copy, an
ONNX Runtime session wrapped in a function), so every backend is scored the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from minillm.model.tokenizer import Tokenizer

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # (batch, seq) int64 -> (batch, seq, vocab)


def held_out_ids(tokenizer: Tokenizer) -> torch.Tensor:
    """The bundled model's held-out KJV text as token ids (the split training never saw)."""
    from minillm.training.data import encode_corpus, load_kjv, split_corpus

    _, held_out = split_corpus(load_kjv())
    return encode_corpus(tokenizer.tok, held_out)


def factbook_ids(tokenizer: Tokenizer) -> torch.Tensor:
    """Modern English prose as token ids, for any model's tokenizer: the CIA World Factbook's
    country backgrounds (public domain; `minillm.training.english`), one blank line apart."""
    from minillm.training.data import encode_corpus
    from minillm.training.english import load_factbook

    return encode_corpus(tokenizer.tok, "\n\n".join(load_factbook()) + "\n")


def _windows(ids: torch.Tensor, window: int, max_windows: int | None) -> tuple[torch.Tensor, ...]:
    n = (len(ids) - 1) // window
    if n <= 0:
        raise ValueError(f"need more than {window} tokens to score one window, got {len(ids)}")
    n = n if max_windows is None else min(n, max_windows)
    return ids[: n * window].view(n, window), ids[1 : n * window + 1].view(n, window)


def _device(logits_fn: LogitsFn) -> torch.device:
    if isinstance(logits_fn, torch.nn.Module):
        return next(logits_fn.parameters()).device
    return torch.device("cpu")


@torch.inference_mode()
def perplexity(
    logits_fn: LogitsFn,
    ids: torch.Tensor,
    window: int,
    batch_size: int = 8,
    max_windows: int | None = None,
) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `window` tokens.

    Deterministic: the same ids always give the same windows; a short tail is dropped, and
    `max_windows` keeps only the first windows (a quicker, still fixed, sample).
    """
    x, y = _windows(ids, window, max_windows)
    device = _device(logits_fn)
    total = 0.0
    for i in range(0, len(x), batch_size):
        logits = logits_fn(x[i : i + batch_size].to(device)).float()
        target = y[i : i + batch_size].to(logits.device)
        total += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
    return math.exp(total / y.numel())


@torch.inference_mode()
def next_token_agreement(
    reference: LogitsFn,
    candidate: LogitsFn,
    ids: torch.Tensor,
    window: int,
    batch_size: int = 8,
    max_windows: int | None = None,
) -> float:
    """Fraction of positions where both functions put the highest logit on the same token."""
    x, _ = _windows(ids, window, max_windows)
    same = 0
    for i in range(0, len(x), batch_size):
        batch = x[i : i + batch_size]
        a = reference(batch.to(_device(reference))).argmax(-1).cpu()
        b = candidate(batch.to(_device(candidate))).argmax(-1).cpu()
        same += (a == b).sum().item()
    return same / x.numel()


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first token where two generations differ (the shorter length if one is
    a prefix of the other): how far two engines agree when exact equality is not promised."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
