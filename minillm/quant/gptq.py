"""GPTQ from scratch (Frantar et al., 2022): INT4 weights chosen to keep the layer's
*output* right on real inputs, not each weight closest to itself.

Round-to-nearest (RTN) minimises ||W - W'|| weight by weight. What matters is the output
on real activations X [in, n]: ||W X - W' X||². Its curvature in W is the Hessian

    H = 2 X X^T / n                      [in, in], the same for every output row,

and Optimal Brain Quantization says how to quantize one input column q of W and correct
the columns not yet quantized so the output error stays minimal:

    err   = (w_q - quant(w_q)) / [H^-1]_qq
    W[:, rest] -= err * [H^-1]_{q, rest}
    H^-1  <- H^-1 with row and column q eliminated

GPTQ's three tricks make that fast enough for a billion weights:

1. Every row gets the same column order, so H^-1 is shared across rows; and the successive
   eliminated inverses are exactly the rows of the upper Cholesky factor U of H^-1
   (H^-1 = U^T U). One Cholesky replaces all the updates.
2. Lazy batches: within a block of `block_size` columns only the block is updated column
   by column; the rest of W gets the block's accumulated error in one matrix product.
3. Dampening: H += damp * mean(diag(H)) * I keeps the Cholesky stable when X is nearly
   rank-deficient (few calibration tokens, dead channels).

Act-order quantizes the columns with the largest diag(H) (most activation energy) first,
while the most columns are left to absorb their error. Group parameters then come from the
original weights ("static groups"), so every group is still a contiguous run of inputs
and the result is a plain `Int4Weight`: `QuantLinear` and the int4 kernels use it as is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minillm.model.transformer import Transformer
from minillm.quant.formats import (
    Int4Weight,
    int4_codes,
    int4_group_params,
    pack_int4,
    split_groups,
)
from minillm.quant.linear import QuantLinear, Scheme, parse_scheme, replace_module
from minillm.quant.sequential import (
    block_linears,
    calibration_states,
    capture_inputs,
    run_block,
)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X X^T / n of input rows x [n, in] (float64 in, float64 out; else fp32)."""
    x = x if x.dtype == torch.float64 else x.float()
    return 2 * x.T @ x / x.shape[0]


def _dequant(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    return (q - (8.0 if zero is None else zero)) * scale


def prepare_hessian(
    w: torch.Tensor, h: torch.Tensor, damp: float, act_order: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W, H, perm): dead inputs (never active: diag 0) zeroed in W with H's diagonal set
    to 1, columns permuted by descending diag(H) if `act_order`, and H dampened."""
    w, h = w.clone(), h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(len(h))
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(len(h), dtype=h.dtype)
    return w, h, perm


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = False,
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
) -> Int4Weight:
    """GPTQ of one weight [out, in] given the Hessian H [in, in] of its inputs, as a
    group-wise INT4 weight. Computes in H's dtype (fp32, or fp64 for exact tests)."""
    if not act_order and block_size % group_size:
        raise ValueError(
            f"block_size={block_size} must be a multiple of group_size={group_size} (so a "
            "group's parameters are found from fully updated columns): use block_size="
            f"{group_size * max(1, block_size // group_size)}"
        )
    dtype = h.dtype
    w, h, perm = prepare_hessian(w.to(dtype), h, damp, act_order)
    out_f, in_f = w.shape
    try:
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError as err:
        raise ValueError(
            f"the Hessian is not positive definite even after dampening {damp}: raise damp "
            "(e.g. 0.1) or calibrate on more tokens"
        ) from err
    n_groups = in_f // group_size
    scale = torch.zeros(out_f, n_groups, dtype=torch.float16)
    zero = None if symmetric else torch.zeros(out_f, n_groups, dtype=dtype)
    if act_order:  # static groups: parameters from the original weights, in input order
        original = torch.empty_like(w)
        original[:, perm] = w
        s, z = int4_group_params(split_groups(original, group_size), symmetric)
        scale[:], zero = s, (None if z is None else z.to(dtype))
    scale_f = scale.to(dtype)  # the grid as the loop uses it (kept in step with `scale`)
    group_of = (perm // group_size).tolist()  # column (in quantization order) -> its group
    codes = torch.zeros(out_f, in_f, dtype=dtype)
    for b0 in range(0, in_f, block_size):
        b1 = min(b0 + block_size, in_f)
        w1, err1 = w[:, b0:b1].clone(), torch.zeros(out_f, b1 - b0, dtype=dtype)
        for i in range(b1 - b0):
            col, g = b0 + i, group_of[b0 + i]
            if not act_order and col % group_size == 0:  # the group's grid from updated W
                s, z = int4_group_params(w1[:, i : i + group_size], symmetric)
                scale[:, g], scale_f[:, g] = s, s.to(dtype)
                if zero is not None:
                    zero[:, g] = z.to(dtype)
            z = None if zero is None else zero[:, g]
            q = int4_codes(w1[:, i], scale_f[:, g], z)
            err = (w1[:, i] - _dequant(q, scale_f[:, g], z)) / u[col, col]
            w1[:, i:].addr_(err, u[col, col:b1], alpha=-1)  # the error feedback
            codes[:, col], err1[:, i] = q, err
        w[:, b1:] -= err1 @ u[b0:b1, b1:]
    codes = codes[:, torch.argsort(perm)]
    packed = pack_int4(codes.to(torch.uint8))
    return Int4Weight(packed, scale, None if zero is None else zero.to(torch.uint8), group_size)


def layer_output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """||W X - W' X|| / ||W X|| on input rows x [n, in]: what GPTQ minimises."""
    ref = x @ w.T
    return ((x @ w_hat.T - ref).norm() / ref.norm()).item()


@torch.inference_mode()
def gptq_quantize_model(
    model: Transformer,
    batches: Iterable[torch.Tensor],
    scheme: str | Scheme = "int4-g128",
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
) -> Transformer:
    """Quantize every linear of every block with GPTQ, in place (`QuantLinear`s holding
    GPTQ's codes); calibration token-id `batches` [B, T]. Block i is calibrated on the
    outputs of the already-quantized blocks before it, as in the paper. The lm_head
    stays in full precision (`quantize_model`'s default, for the same reason)."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    if scheme.kind != "int4":
        raise ValueError(f"GPTQ here produces int4 group-wise weights, got scheme {scheme}")
    calib = calibration_states(model, batches)
    for block in model.model.layers:
        names = block_linears(block)
        inputs = capture_inputs(block, calib, names)
        for group in shared_inputs(names, inputs):
            # Linears reading one input (q/k/v, gate/up) share its Hessian; GPTQ treats
            # rows independently, so one call on their stacked rows gives each the same
            # codes as its own call would, in one column loop instead of several.
            lins = [block.get_submodule(name) for name in group]
            qw = gptq_quantize(
                torch.cat([lin.weight.detach().float() for lin in lins]),
                hessian(inputs[group[0]]),
                scheme.group_size,
                scheme.symmetric,
                act_order,
                damp,
                block_size,
            )
            for name, lin, part in zip(group, lins, split_rows(qw, lins), strict=True):
                replace_module(block, name, QuantLinear(lin, scheme, quantized=part))
        run_block(block, calib)
    return model


def shared_inputs(names: list[str], inputs: dict[str, torch.Tensor]) -> list[list[str]]:
    """`names` (in forward order) cut into runs of linears that received the same input."""
    runs: list[list[str]] = []
    for name in names:
        if runs and torch.equal(inputs[runs[-1][0]], inputs[name]):
            runs[-1].append(name)
        else:
            runs.append([name])
    return runs


def split_rows(qw: Int4Weight, linears: list[nn.Module]) -> list[Int4Weight]:
    """The stacked weight cut back into one `Int4Weight` per linear (rows in order)."""
    sizes = [lin.out_features for lin in linears]
    parts = zip(
        qw.packed.split(sizes),
        qw.scale.split(sizes),
        qw.zero.split(sizes) if qw.zero is not None else [None] * len(sizes),
        strict=True,
    )
    return [Int4Weight(p, s, z, qw.group_size) for p, s, z in parts]
