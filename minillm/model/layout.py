"""Weight layout for batch-1 decode on a CPU: store each linear layer's weight transposed.

A decode step multiplies one row x [1, in] by every weight W [out, in]: a matrix-vector
product that reads each weight once and does one multiply-add per 4 bytes it reads, so its
speed is the speed at which the kernel streams W from memory. PyTorch keeps W row-major
(each output's `in` weights together) and `F.linear(x, W)` computes x @ W.T; on a CPU the
BLAS matrix-vector kernel for that layout reads a tall matrix such as SmolLM2's tied
embedding / LM head (49,152 x 576) at about half the speed it reads the same bytes laid
out the other way, [in, out] (each input's `out` weights together: x @ W_t accumulates
rows of W_t into the output, a stream the hardware prefetcher follows). Chapter 02 measures
both on the real model (`benchmarks/kv_cache.py`).

`decode_layout(model)` re-lays every linear weight (the tied embedding included) as a
transposed view of an [in, out] buffer: the same tensor to every reader (same values and
shape, `state_dict` and `save_model` unchanged: it saves contiguous copies), so
`F.linear` passes the buffer to BLAS untransposed. Nothing is copied at decode time; the
re-layout costs one copy of the weights once. A prefill (many rows at once, a matrix
product) runs at the same speed either way. llama.cpp makes the same kind of choice with its
own kernels and block layouts.
"""

from __future__ import annotations

import torch
from torch import nn


def is_decode_layout(weight: torch.Tensor) -> bool:
    """True when `weight` [out, in] is the transpose of a contiguous [in, out] buffer."""
    return weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()


@torch.no_grad()
def decode_layout(model: nn.Module) -> nn.Module:
    """Re-lay every `nn.Linear` weight of `model` in place as [in, out] in memory (a
    transposed view), keeping tied weights tied. Returns the model. Idempotent."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and not is_decode_layout(module.weight):
            # .data: the Parameter object stays the same, so a tied embedding (the same
            # Parameter as the LM head) follows, and optimisers or hooks keep their handle.
            module.weight.data = module.weight.data.t().contiguous().t()
    return model
