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
`F.linear` passes the buffer to BLAS untransposed. The layers that read the same input go
side by side in one buffer (q, k and v; gate and up: `SideBySide`), so each group is one
matrix-vector product over a wider matrix instead of two or three narrow ones: fewer calls,
and a longer stream for the prefetcher (k and v are 192 outputs each on SmolLM2, which BLAS
reads slowest of all). Nothing is copied at decode time; the re-layout costs one copy of
the weights once. A prefill (many rows at once, a matrix product) runs at the same speed
either way. llama.cpp makes the same kind of choice with its own kernels and block layouts.

Faster still, and in the layout as loaded: `use_matvec(model)` runs each linear layer's
inputs of a few rows through minillm's own C kernel (`minillm.kernels.matvec`), which
streams each weight row once at close to the memory's speed (chapter 05 measures it
against this layout, a compiled step and llama.cpp). The engine, `serve` and the command
line use it by default for fp32 on a CPU (`matvec_applies`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from minillm.kernels import matvec, rowops
from minillm.model.transformer import MLP, Attention, SideBySide, Transformer, apply_rope, rms_norm

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def is_decode_layout(weight: torch.Tensor) -> bool:
    """True when `weight` [out, in] is the transpose of [in, out] rows laid out one after
    another: its own buffer, or its block of columns in a `SideBySide` buffer."""
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0] > 1


def side_by_side(*linears: nn.Linear) -> SideBySide:
    """One [in, sum of outs] buffer holding `linears`' weights (and biases) as its column
    blocks; each layer's weight (bias) becomes a view of its block."""
    with_bias = [m.bias is not None for m in linears]
    if any(with_bias) and not all(with_bias):
        raise ValueError("side_by_side needs all of the layers with a bias, or none")
    weight = torch.cat([m.weight.detach().t() for m in linears], dim=1).contiguous()
    bias = torch.cat([m.bias.detach() for m in linears]) if all(with_bias) else None
    sizes = tuple(m.out_features for m in linears)
    start = 0
    for m, size in zip(linears, sizes, strict=True):
        # .data: the Parameter object stays the same, so optimisers or hooks keep their handle
        m.weight.data = weight[:, start : start + size].t()
        if bias is not None:
            m.bias.data = bias[start : start + size]
        start += size
    return SideBySide(weight, bias, linears, sizes)


def _linears(module: nn.Module, *names: str) -> list[nn.Linear] | None:
    layers = [getattr(module, n, None) for n in names]
    return layers if all(type(m) is nn.Linear for m in layers) else None  # type: ignore[misc]


@torch.no_grad()
def decode_layout(model: nn.Module) -> nn.Module:
    """Re-lay every `nn.Linear` weight of `model` in place as [in, out] in memory (a
    transposed view), the q/k/v and gate/up projections side by side, keeping tied weights
    tied. Returns the model. Idempotent."""
    for module in model.modules():
        if isinstance(module, Attention) and (qkv := _linears(module, *QKV)):
            if module.qkv is None or not module.qkv.serves(*qkv):
                module.qkv = side_by_side(*qkv)
        if isinstance(module, MLP) and (gate_up := _linears(module, *GATE_UP)):
            if module.gate_up is None or not module.gate_up.serves(*gate_up):
                module.gate_up = side_by_side(*gate_up)
    for module in model.modules():
        if isinstance(module, nn.Linear) and not is_decode_layout(module.weight):
            # .data: the Parameter object stays the same, so a tied embedding (the same
            # Parameter as the LM head) follows, and optimisers or hooks keep their handle.
            module.weight.data = module.weight.data.t().contiguous().t()
    return model


class MatVecLinear(nn.Linear):
    """An `nn.Linear` whose inputs of at most `matvec.MAX_ROWS` rows run through the C
    kernel; any other input, a compile or a backward pass takes `F.linear`. Same
    parameters, same state dict: `use_matvec` swaps it in for each `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = None if torch.compiler.is_compiling() else matvec.try_matvec(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y


def matvec_applies(model: nn.Module) -> bool:
    """Whether `use_matvec` runs here and speeds `model` up: fp32 weights on a CPU, and the
    kernel built."""
    weight = next(model.parameters())
    return weight.dtype == torch.float32 and weight.is_cpu and matvec.matvec_status()[0]


@torch.no_grad()
def use_matvec(model: nn.Module) -> nn.Module:
    """Run every `nn.Linear` of `model` through the C kernel for its inputs of a few rows,
    in place: each becomes a `MatVecLinear` holding the same `Parameter`s, so tied weights
    stay tied. Returns the model. Raises RuntimeError naming the fix where the kernel
    cannot be built. A model in `decode_layout` goes back to rows (the kernel streams each
    weight row, where BLAS wanted the transpose) and drops its side-by-side buffers. A
    `Transformer` also takes the C RMSNorm and rotary embedding (`use_row_ops`)."""
    ok, why = matvec.matvec_status()
    if not ok:
        raise RuntimeError(f"the C matvec kernel cannot run here: {why}")
    for module in model.modules():
        if isinstance(module, Attention):
            module.qkv = None
        if isinstance(module, MLP):
            module.gate_up = None
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                bias = child.bias is not None
                swapped = MatVecLinear(child.in_features, child.out_features, bias, "meta")
                swapped.weight, swapped.bias = child.weight, child.bias  # the same Parameters
                if not swapped.weight.is_contiguous():  # a tied embedding follows
                    swapped.weight.data = swapped.weight.data.contiguous()
                setattr(module, name, swapped)
    return use_row_ops(model)


def use_row_ops(model: nn.Module) -> nn.Module:
    """Give a minillm `Transformer` the C RMSNorm and rotary embedding of
    `minillm.kernels.rowops` as its ops (fp32 CPU tensors; anything else takes the PyTorch
    ops, which they call in that case). Returns the model; other modules pass unchanged."""
    if isinstance(model, Transformer):
        norm = functools.partial(rowops.rms_norm, fallback=rms_norm)
        rope = functools.partial(rowops.rope, fallback=apply_rope)
        model.ops = dataclasses.replace(model.ops, norm=norm, rope=rope)
    return model
