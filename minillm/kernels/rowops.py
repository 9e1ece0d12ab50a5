"""A decode step's RMSNorm and rotary embedding in C (`rowops.c`), for the model's `Ops`.

At one token a step, `rms_norm` and `apply_rope` (minillm.model.transformer) are seven or
eight PyTorch ops each on a few hundred floats: every op pays its dispatch and allocates a
temporary, and together they cost more than the arithmetic. `rms_norm` and `rope` here do
the same math in one C pass each, with the same signatures as the model's ops, so a model
takes them as `model.ops` (`minillm.model.layout.use_matvec` does, beside the C matvec
kernel). They take fp32 CPU tensors with no gradient wanted and hand anything else to the
PyTorch version, unchanged; the library is `matvec.py`'s, compiled once per machine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.kernels.matvec import library

Fallback = Callable[..., torch.Tensor]


def _plain(*ts: torch.Tensor) -> bool:
    """fp32 CPU tensors, no gradient wanted, no compile tracing: what the C row ops take."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    return all(t.dtype == torch.float32 and t.is_cpu and not (grad and t.requires_grad) for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fallback: Fallback) -> torch.Tensor:
    """`fallback(x, weight, eps)`'s RMSNorm over the last dimension, in C where it applies."""
    lib = library()[0]
    if lib is None or not _plain(x, weight) or not weight.is_contiguous():
        return fallback(x, weight, eps)
    x = x.contiguous()
    y = torch.empty_like(x)
    dim = x.shape[-1]
    lib.rms_norm_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fallback: Fallback) -> torch.Tensor:
    """`fallback(x, cos, sin)`'s rotation of x [B, H, T, d] by tables [B, T, d], in C where
    it applies (x's channels contiguous, the tables contiguous); the result is contiguous."""
    lib = library()[0]
    if (
        lib is None
        or not _plain(x, cos, sin)
        or x.dim() != 4
        or x.stride(-1) != 1
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.shape != (x.shape[0], x.shape[2], x.shape[3])
        or sin.shape != cos.shape
    ):
        return fallback(x, cos, sin)
    b, h, t, d = x.shape
    y = x.new_empty(b, h, t, d)
    sb, sh, st, _ = x.stride()
    lib.rope_f32(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), b, h, t, d, sb, sh, st)
    return y
