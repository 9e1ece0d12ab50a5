"""Chapter 06 exercises: 4-bit weights you pack, quantize and multiply yourself.

Notebook 06 builds `minillm/quant/formats.py`: INT8 per channel, group-wise INT4 packed two codes
per byte, NF4. Here you write the core of group-wise INT4 in plain torch:

    pack_int4             two 4-bit codes per uint8 byte (and back: unpack_int4)
    unpack_int4
    quantize_groupwise    asymmetric 4-bit codes, one scale and zero point per group
    dequantize_groupwise  codes back to floats
    int4_linear           y = x @ W^T straight from the packed weight
    dequantize_q4_1       the real model's format: llama.cpp Q4_1 blocks of 32 weights
    gptq_columns          GPTQ's column-by-column rounding with error feedback
    awq_scale_search      AWQ's search for per-input-channel scales

The format is minillm's, so the tests check your bytes against `minillm.quant` (a
weight packed by you unpacks with minillm and the other way round). Replace each
`raise NotImplementedError(...)` with your code. Grade them with

    make grade CH=06    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch06

and one exercise with `-k "ch06 and pack"`. The answers are in
`solutions/ch06_quantization.py`: try first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dimension.

    `codes` is a uint8 tensor [..., n] with values 0..15 and n even. The result is a
    uint8 tensor [..., n / 2] where byte j holds code 2j in its LOW nibble (bits 0-3)
    and code 2j+1 in its HIGH nibble (bits 4-7):

        codes [3, 10]  ->  byte 0xA3 = 10 * 16 + 3 = 163

    This is how minillm (and most INT4 formats: GPTQ, AWQ, llama.cpp) halve the bytes a
    weight occupies: a 4-bit code has no dtype of its own, so two share a byte.

    Raise a ValueError naming the fix when n is odd ("pad to an even length") or a code
    is outside 0..15 (signed codes -8..7 must be offset by +8 first).

    Hints: slicing `codes[..., 0::2]` and `codes[..., 1::2]`, the shift `<< 4` and the
    bitwise or `|` work on uint8 tensors. Work on the uint8 dtype throughout: a shift on
    int8 would overflow into the sign bit.
    """
    raise NotImplementedError("ch06: implement pack_int4")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Undo `pack_int4`: uint8 [..., m] -> uint8 codes [..., 2m] in 0..15.

    Code 2j is the low nibble of byte j (`byte & 0xF`), code 2j+1 its high nibble
    (`byte >> 4`). The two must end up interleaved in their original order, so that
    `unpack_int4(pack_int4(c))` equals `c` exactly for every possible byte (all 256 of
    them: the test tries each).

    In a real kernel this happens in registers right before the multiply, so that only
    the packed bytes travel from memory: at batch-1 decode the bytes read ARE the time.

    Hint: `torch.stack([lo, hi], dim=-1)` gives [..., m, 2]; flattening the last two
    dimensions interleaves them.
    """
    raise NotImplementedError("ch06: implement unpack_int4")


def quantize_groupwise(
    w: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit quantization of a weight [out, in].

    Split every row into groups of `group_size` consecutive inputs. For each group
    with minimum lo and maximum hi (widen the range to include 0: lo <= 0 <= hi):

        scale = (hi - lo) / 15            (one float per group; avoid dividing by 0)
        zero  = round(-lo / scale)        (an integer 0..15: the code that means 0.0)
        code  = clamp(round(w / scale) + zero, 0, 15)

    Return (packed, scales, zeros): packed = pack_int4(codes) of shape [out, in / 2];
    scales float32 [out, in / group_size]; zeros uint8 [out, in / group_size].

    Raise a ValueError naming the fix if `in` is not divisible by `group_size` (say
    which group sizes would divide it). The test requires the relative error
    ||w - dequantize(quantize(w))|| / ||w|| of a Gaussian weight to stay below 0.09 at
    group size 32 and 0.11 at 128, and to shrink as groups get smaller: one large weight
    only spoils the step size of its own group.
    """
    raise NotImplementedError("ch06: implement quantize_groupwise")


def dequantize_groupwise(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Float32 weight [out, in] from `quantize_groupwise`'s output.

    Every code c of group g of a row becomes (c - zeros[row, g]) * scales[row, g]. The
    codes come from `unpack_int4(packed)` (shape [out, in]); reshape them to
    [out, in / group_size, group_size] so that scales and zeros, [out, groups], broadcast
    with a trailing `[..., None]`.

    The result must equal minillm's `Int4Weight(packed, scales, zeros, group_size)
    .dequantize()` for the same inputs (minillm stores scales in fp16; the test gives
    both the same scales, so the results must agree to float32 rounding).
    """
    raise NotImplementedError("ch06: implement dequantize_groupwise")


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """y = x @ W^T for x [..., in] and W stored as `quantize_groupwise` returns it.

    The simple way dequantizes the whole W and calls a matmul, which is what minillm's
    QuantLinear does on CPU. Try the way a fused kernel sees it instead: the sum over
    `in` splits into groups, and inside a group the scale and zero are constants:

        y[n] = sum_g scale[n, g] * ( sum_k x[k] * code[n, k] - zero[n, g] * sum_k x[k] )

    (k running over group g). Either way is accepted: the test compares your y with
    x @ dequantized_W^T to 1e-4 relative error for a batch of decode rows [3, in], and
    checks the output shape [..., out] for x with extra leading dimensions.
    """
    raise NotImplementedError("ch06: implement int4_linear")


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_1 blocks -> float32 weights: uint8 [n_blocks, 20] -> [n_blocks, 32].

    SmolLM2's GGUF file (the course's real model) stores most matrices as Q4_1: each run
    of 32 consecutive weights of a row is one 20-byte block

        bytes 0-1    d  (fp16, little-endian)   the step between levels
        bytes 2-3    m  (fp16, little-endian)   the value of code 0: the group's minimum
        bytes 4-19   16 bytes, two 4-bit codes q per byte

    and weight i of the block is w = d * q_i + m. Careful with the nibble order: byte j
    holds weight j in its LOW nibble and weight j + 16 in its HIGH nibble (the first 16
    weights are all the low nibbles), not weights 2j and 2j+1 as in `pack_int4`.

    Compute in float32 in that order (d * q, then + m), so the test can compare your
    values with the `gguf` package's reference dequantizer bit for bit; it also checks
    the first blocks of a real Q4_1 tensor of the model. Hint: `t.view(torch.float16)`
    reinterprets a contiguous uint8 tensor's bytes (pairs of bytes become fp16 values).
    """
    raise NotImplementedError("ch06: implement dequantize_q4_1")


def gptq_columns(
    w: torch.Tensor,
    u: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """GPTQ's core: round the columns of w [out, in] one at a time, left to right, and
    push each column's rounding error onto the columns not rounded yet. Returns the
    rounded (dequantized) weight [out, in].

    The grid is given: column j belongs to group g = j // group_size, and a value v
    rounds to (clamp(round(v / scale[:, g]) + zero[:, g], 0, 15) - zero[:, g]) *
    scale[:, g] (asymmetric INT4; scale and zero are [out, in / group_size]).

    The error feedback: `u` [in, in] is the upper Cholesky factor of H^-1, where
    H = 2 X^T X / n is the Hessian of the layer's output error over calibration inputs
    X [n, in]. After rounding column j (current values c, rounded r):

        err = (c - r) / u[j, j]
        W[:, j+1:] -= err[:, None] * u[j, j+1:][None, :]

    so the columns still to come absorb the error, in proportion to how their inputs
    correlate with input j. (Row j of u is what is left of H^-1 after eliminating the
    columns before j: the Cholesky factor does all of Optimal Brain Quantization's
    inverse updates at once.) Work on a copy: leave `w` unchanged.

    Graded: with u = identity (uncorrelated inputs) the result is plain round-to-nearest;
    on correlated inputs it equals the explicit OBQ update with H^-1, and its layer output
    error on new inputs is below 80% of round-to-nearest's.
    """
    raise NotImplementedError("ch06: implement gptq_columns")


def awq_scale_search(
    x: torch.Tensor,
    w: torch.Tensor,
    fake_quantize: Callable[[torch.Tensor], torch.Tensor],
    n_grid: int = 20,
) -> torch.Tensor:
    """AWQ's scale search for one linear layer: per-input-channel scales s [in] that make
    rounding hurt the layer's output least. x [n, in] are calibration inputs, w [out, in]
    the weight, `fake_quantize(w)` rounds a weight and returns its float values (group-wise
    INT4 in the test).

    Scaling input channel j of the weight up by s_j and its activation down by s_j
    changes nothing in float ((W diag(s)) (x / s) = W x), but the rounding of column j
    now costs 1/s_j as much. Channels with large activations should get large s. AWQ
    ties s to the activations with one knob alpha in [0, 1):

        s = mean_n |x[n, j]| ** alpha        (clamp tiny values to 1e-4)
        s = s / sqrt(s.max() * s.min())     (so the weight's overall range stays put)

    For alpha = i / n_grid, i = 0 .. n_grid - 1, score the candidate by the relative
    output error ||x w^T - (x / s) Q(w s)^T||^2 / ||x w^T||^2 and return the s with the
    smallest one. alpha = 0 gives s = 1: plain rounding, so the search never does worse
    than round-to-nearest on x.

    Graded: s is positive, finite, shape [in]; on x it is never worse than s = 1; on new
    inputs where a few channels carry 20x larger activations its output error is below
    85% of round-to-nearest's.
    """
    raise NotImplementedError("ch06: implement awq_scale_search")
