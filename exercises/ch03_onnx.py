"""Chapter 03 exercises: make PyTorch code exportable to ONNX.

`torch.onnx.export(..., dynamo=True)` (the default exporter) first captures the code
with `torch.export`: it runs the function on symbolic tensors whose *values* it does
not know, only their shapes (and with dynamic shapes, not even all of those). Then it
translates each captured op into ONNX. Two things break that, and each exercise here
is a function that an eager PyTorch programmer writes one way and an exporter needs
written another:

    clip_by_max_norm     a Python `if` on a tensor's value -> compute both, `torch.where`
    lower_median         an op with no ONNX translation (median) -> sort + gather
    padded_causal_mask   a "fast path" that tests the data, and shapes that must stay
                         dynamic (batch, queries, slots; a single query included)

Each test runs your function eagerly against a reference, then exports it with
dynamic shapes, checks the graph with `onnx.checker` and runs it on ONNX Runtime on
shapes other than the example's: ORT must match PyTorch within 1e-5. Plain torch only.
Grade them with

    make grade CH=03    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch03

and one exercise with `-k "ch03 and median"`. The answers are in `solutions/ch03_onnx.py`:
try first.
"""

from __future__ import annotations

import torch


def clip_by_max_norm(x: torch.Tensor, max_abs: float) -> torch.Tensor:
    """Scale `x` down so that its largest absolute value is at most `max_abs`.

    The eager version everyone writes first:

        peak = x.abs().max()
        if peak > max_abs:                 # a Python bool from a tensor's value
            return x * (max_abs / peak)
        return x

    `torch.export` cannot decide that `if`: it does not know `peak`'s value when it
    captures the graph, and stops with a "data-dependent" error (GuardOnDataDependent
    SymNode). Rewrite it without Python control flow on tensor values: compute the
    scale for both cases as tensors and let `torch.where(condition, a, b)` choose at run
    time (ONNX `Where`). `torch.cond(pred, true_fn, false_fn, operands)` is the other
    way (ONNX `If`), worth it when a branch is expensive; here both are one multiply.

    Args:
        x: a float tensor of any shape (the whole tensor shares one scale).
        max_abs: the bound, > 0.

    Returns:
        A tensor like `x`: `x` itself (values unchanged) when max |x| <= max_abs, else
        `x * (max_abs / max |x|)`, whose largest |value| is then exactly `max_abs`.

    Pitfalls: an all-zero `x` must come back as zeros, not NaN: `where` evaluates
    *both* branches, so a division by a zero peak happens even when its result is not
    chosen (0/0 = NaN would not be chosen here, but guard it anyway: clamp the divisor).
    Take the peak with `x.abs().max()`: `x.abs().amax()` with no `dim` exports in
    torch but has no ONNX translation in onnxscript 0.7 (a real exporter gap).
    """
    raise NotImplementedError("ch03: implement clip_by_max_norm")


def lower_median(x: torch.Tensor) -> torch.Tensor:
    """The median of the last axis, as `torch.median(x, dim=-1).values` gives it.

    PyTorch's median of n values is the *lower* median: the element at index
    (n - 1) // 2 of the sorted values (for n = 4, the 2nd smallest, not the mean of
    the middle two). `torch.median` has no ONNX translation in the exporter: export
    fails with "No ONNX function found for aten.median.dim". Write it with ops that
    do translate: `x.sort(dim=-1)` (exported as ONNX TopK) and `gather` (or indexing
    at a fixed index) along the last axis.

    Args:
        x: float tensor [..., n], n >= 1 (any leading dims).

    Returns:
        Tensor [...]: the lower median of each row, equal to
        `torch.median(x, dim=-1).values` exactly (it is one of the inputs, no
        arithmetic involved).

    Pitfalls: not the mean of the two middle values for even n (that is numpy's
    median); keep the leading dims as they are (a [2, 3, 5] input gives [2, 3]); the
    index depends on n = x.shape[-1], which the exporter knows when it traces.
    """
    raise NotImplementedError("ch03: implement lower_median")


def padded_causal_mask(attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """The attention mask of a decoder step over padded sequences, as a graph can build it.

    A decoder step attends from its `query_len` new tokens to all `S` slots: the past
    ones and its own, which are the *last* `query_len` slots. `attention_mask [B, S]`
    marks real slots with 1 and padding with 0 (prompts of different lengths,
    left-padded). Query t (slot q = S - query_len + t) may attend to slot s when

        (s <= q and attention_mask[b, s] == 1)  or  s == q

    The `or s == q` lets a padding query attend to itself: otherwise its whole row is
    masked, softmax over nothing gives NaN, and the NaN reaches later layers through
    that slot's values (0 weight x NaN = NaN).

    An eager version might start with a fast path `if attention_mask.all(): return
    None` (then SDPA's `is_causal=True`): a branch on data, which does not export,
    and which would change the graph's outputs between calls anyway. Build the mask
    from `torch.arange` comparisons alone, so it works for any B, S and query_len,
    including query_len = 1 (one decode step) and query_len = S (a prefill, no past).

    Args:
        attention_mask: int64 or bool [B, S], 1/True = real token.
        query_len: T, 1 <= T <= S.

    Returns:
        bool [B, 1, T, S], True = attend (the layout SDPA's `attn_mask` takes).
    """
    raise NotImplementedError("ch03: implement padded_causal_mask")
