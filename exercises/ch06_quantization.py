"""Chapter 06 exercises: 4-bit weights you pack, quantize and multiply yourself.

Notebook 06 builds `minillm/quant/formats.py`: INT8 per channel, group-wise INT4 packed two codes
per byte, NF4. Here you write the core of group-wise INT4 in plain torch:

    pack_int4             two 4-bit codes per uint8 byte (and back: unpack_int4)
    unpack_int4
    quantize_groupwise    asymmetric 4-bit codes, one scale and zero point per group
    dequantize_groupwise  codes back to floats
    int4_linear           y = x @ W^T straight from the packed weight

The format is minillm's, so the tests check your bytes against `minillm.quant` (a
weight packed by you unpacks with minillm and the other way round). Replace each
`raise NotImplementedError(...)` with your code. Grade them with

    make grade CH=06    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch06

and one exercise with `-k "ch06 and pack"`. The answers are in
`solutions/ch06_quantization.py`: try first.
"""

from __future__ import annotations

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
