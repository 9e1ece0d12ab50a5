"""Weight quantization from scratch: INT8, group-wise INT4, NF4, and a linear layer that
stores the packed weights and dequantizes them on the fly.

Every format here maps a float to a small integer code and back:

    INT8 symmetric (absmax)    q = round(w / s),          s = absmax / 127,   w' = q * s
    INT8/INT4 asymmetric       q = round(w / s) + z,      s = (max - min) / (2^b - 1)
    NF4 (QLoRA)                q = nearest of 16 codes to w / absmax,         w' = code[q] * absmax

The scale (and zero point) is shared by a whole tensor, one output channel (a row of
an `nn.Linear` weight [out, in]), or a group of `group_size` consecutive inputs of one
row. Smaller groups follow the weights more closely and cost more scale bytes.

`quantize_model(model, "int4-g128")` swaps every `nn.Linear` of a minillm model for a
`QuantLinear`. Activation quantization (W8A8) and LLM.int8()'s outlier decomposition are
simulated in `QuantLinear.forward` to show why per-tensor INT8 activations hurt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# QLoRA's NormalFloat4: 16 values, quantiles of N(0, 1) rescaled to [-1, 1], with an exact
# zero (7 negative, 8 positive levels). These are the values bitsandbytes ships.
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171447754,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)


DQ_BLOCK = 256  # double quantization: one fp32 scale per 256 first-level scales (QLoRA)


def nf4_code_from_normal(offset: float = 0.9677083) -> torch.Tensor:
    """Rebuild the NF4 table from N(0,1) quantiles (QLoRA eq. 4, asymmetric: 8 positive and
    7 negative levels around an exact 0), to show where the constants come from."""
    normal = torch.distributions.Normal(0.0, 1.0)
    pos = normal.icdf(torch.linspace(offset, 0.5, 9)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8)[:-1])
    code = torch.cat([pos, torch.zeros(1), neg]).sort().values
    return code / code.abs().max()


def _check_2d(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")


def absmax_quantize(
    w: torch.Tensor, bits: int = 8, per_channel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization: int8 codes in [-(2^(b-1)-1), 2^(b-1)-1] and fp32 scales
    (one per row of `w` if `per_channel`, else one for the tensor). w ~ q * scale."""
    qmax = 2 ** (bits - 1) - 1
    amax = w.abs().amax(dim=-1, keepdim=True) if per_channel else w.abs().amax()
    scale = amax.float().clamp(min=1e-12) / qmax
    q = (w.float() / scale).round().clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def zeropoint_quantize(
    w: torch.Tensor, bits: int = 8, per_channel: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization: uint8 codes in [0, 2^b - 1], fp32 scales and integer zero
    points (per row or per tensor) so that min..max maps onto the full code range.
    w ~ (q - zero) * scale; the zero point makes w = 0 exactly representable."""
    qmax = 2**bits - 1
    lo = w.amin(dim=-1, keepdim=True) if per_channel else w.amin()
    hi = w.amax(dim=-1, keepdim=True) if per_channel else w.amax()
    lo, hi = lo.float().clamp(max=0), hi.float().clamp(min=0)  # keep 0 inside the range
    scale = ((hi - lo) / qmax).clamp(min=1e-12)
    zero = (-lo / scale).round().clamp(0, qmax)
    q = (w.float() / scale + zero).round().clamp(0, qmax).to(torch.uint8)
    return q, scale, zero.to(torch.uint8)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 values of integer codes: (q - zero) * scale (zero = 0 for symmetric codes)."""
    q = q.float()
    return (q if zero is None else q - zero.float()) * scale.float()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes (uint8 values 0..15) per byte along the last dim: element 2i in the
    low nibble, 2i+1 in the high nibble. The last dim must be even."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension, got {q.shape[-1]}: pad it")
    if q.dtype != torch.uint8 or (q.numel() and int(q.max()) > 15):
        raise ValueError("pack_int4 takes uint8 codes in 0..15 (offset signed codes by +8)")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., n] -> uint8 codes [..., 2n]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def split_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, in / group_size, group_size], naming the fix if it does not divide."""
    _check_2d(w)
    out_f, in_f = w.shape
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    if in_f % group_size:
        divisors = [g for g in (32, 64, 128, 256) if in_f % g == 0]
        raise ValueError(
            f"in_features={in_f} is not divisible by group_size={group_size}: use a group "
            f"size that divides it ({divisors or 'none of 32/64/128/256'}), or keep this "
            "layer in full precision (quantize_model(..., keep=[its name]))"
        )
    return w.reshape(out_f, in_f // group_size, group_size)


@dataclass
class Int4Weight:
    """Group-wise 4-bit weight: packed codes [out, in/2], one fp16 scale per group and
    (asymmetric) one uint8 zero point per group, or zero = 8 for symmetric codes; or, in
    llama.cpp's Q4_1 form, one fp16 `minimum` per group instead of a zero point:
    w = q * scale + minimum, any value rather than a whole number of steps."""

    packed: torch.Tensor  # uint8 [out, in / 2]
    scale: torch.Tensor  # fp16 [out, in / group_size]
    zero: torch.Tensor | None  # uint8 [out, in / group_size], None = symmetric (zero 8)
    group_size: int
    minimum: torch.Tensor | None = None  # fp16 [out, in / group_size]: Q4_1 (zero unused)

    def dequantize(self) -> torch.Tensor:
        """fp32 weight [out, in]."""
        q = unpack_int4(self.packed).float()
        out_f, in_f = q.shape
        q = q.view(out_f, in_f // self.group_size, self.group_size)
        scale = self.scale.float()[..., None]
        if self.minimum is not None:
            return (q * scale + self.minimum.float()[..., None]).view(out_f, in_f)
        zero = 8.0 if self.zero is None else self.zero.float()[..., None]
        return ((q - zero) * scale).view(out_f, in_f)

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.scale, self.zero, self.minimum)
        return sum(t.nbytes for t in parts if t is not None)


def int4_group_params(
    g: torch.Tensor, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (fp16, as stored) and zero point (float codes, None if `symmetric`) of each
    group of `g` [..., group_size]: min..max (0 kept inside) onto codes 0..15, or absmax
    onto -7..7. GPTQ and AWQ pick their grids with this same function."""
    if symmetric:
        return (g.abs().amax(-1) / 7).clamp(min=1e-8).half(), None
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()
    return scale, (-lo / scale.float()).round().clamp(0, 15)


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """Codes 0..15 (float) of `w` on the grid of `int4_group_params` (scale and zero
    broadcast against `w`; symmetric codes -7..7 are stored offset by 8)."""
    s = scale.float()
    if zero is None:
        return (w / s).round().clamp(-7, 7) + 8
    return (w / s + zero).round().clamp(0, 15)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """Group-wise INT4 of a weight [out, in]: each run of `group_size` inputs of a row gets
    its own scale (and zero point unless `symmetric`: codes -7..7 stored as 1..15)."""
    g = split_groups(w.float(), group_size)
    scale, zero = int4_group_params(g, symmetric)
    q = int4_codes(g, scale[..., None], None if zero is None else zero[..., None])
    packed = pack_int4(q.to(torch.uint8).view(w.shape))
    return Int4Weight(packed, scale, None if zero is None else zero.to(torch.uint8), group_size)


def quantize_q4_1(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """llama.cpp's Q4_1 of a weight [out, in]: per group of `group_size` inputs of a row,
    scale = (max - min) / 15 and minimum = min, both stored fp16, codes round((w - min) /
    scale). The grid spans the group's own range, 0 inside it or not; the price is a
    second fp16 per group where `quantize_int4` stores a 1-byte zero point."""
    g = split_groups(w.float(), group_size)
    lo, hi = g.amin(-1).half(), g.amax(-1)
    scale = ((hi - lo.float()) / 15).clamp(min=1e-8).half()
    q = ((g - lo.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
    return Int4Weight(pack_int4(q.to(torch.uint8).view(w.shape)), scale, None, group_size, lo)


def _nf4_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2]: the two NF4 values (low nibble, high nibble) each byte encodes."""
    byte = torch.arange(256, dtype=torch.uint8)
    return NF4_CODE[unpack_int4(byte[:, None]).long()].to(device)


@dataclass
class NF4Weight:
    """Blockwise NF4: packed codes [out, in/2] indexing `NF4_CODE`, and one absmax per block,
    fp32 or (double quantization) int8 codes with an fp32 scale per 256 blocks + an offset."""

    packed: torch.Tensor  # uint8 [out, in / 2]
    absmax: torch.Tensor  # fp32 [out, in / block] (or int8 codes when double-quantized)
    block_size: int
    dq_scale: torch.Tensor | None = None  # fp32 [ceil(blocks / 256)]
    dq_offset: torch.Tensor | None = None  # fp32 scalar: mean absmax, subtracted before int8

    def scales(self) -> torch.Tensor:
        """The per-block absmax, dequantized if double-quantized."""
        if self.dq_scale is None:
            return self.absmax
        flat = self.absmax.flatten().float()
        n = flat.numel()
        pad = -n % DQ_BLOCK
        blocks = F.pad(flat, (0, pad)).view(-1, DQ_BLOCK) * self.dq_scale[:, None]
        return (blocks.flatten()[:n] + self.dq_offset).view(self.absmax.shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 weight [out, in]."""
        # one lookup per byte: the pair of NF4 values its two nibbles stand for
        pairs = _nf4_pairs(self.packed.device).index_select(0, self.packed.flatten().int())
        out_f, in_f = self.packed.shape[0], self.packed.shape[1] * 2
        codes = pairs.view(out_f, in_f // self.block_size, self.block_size)
        return (codes * self.scales()[..., None]).view(out_f, in_f)

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.absmax, self.dq_scale, self.dq_offset)
        return sum(t.nbytes for t in parts if t is not None)


def quantize_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = False) -> NF4Weight:
    """NF4 of a weight [out, in] with one absmax per `block_size` inputs (bitsandbytes'
    default 64); `double_quant` stores those absmax as int8 (QLoRA's double quantization)."""
    g = split_groups(w.float(), block_size)
    absmax = g.abs().amax(-1).clamp(min=1e-12)
    normed = g / absmax[..., None]
    # nearest code: compare with the 15 midpoints between neighbouring codes
    mids = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
    q = torch.bucketize(normed, mids).to(torch.uint8)
    packed = pack_int4(q.view(w.shape))
    if not double_quant:
        return NF4Weight(packed, absmax, block_size)
    offset = absmax.mean()
    flat = absmax.flatten() - offset
    n = flat.numel()
    blocks = F.pad(flat, (0, -n % DQ_BLOCK)).view(-1, DQ_BLOCK)
    q2, s2 = absmax_quantize(blocks, bits=8, per_channel=True)
    codes = q2.flatten()[:n].view(absmax.shape)
    return NF4Weight(packed, codes, block_size, s2.flatten(), offset)
