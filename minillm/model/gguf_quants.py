"""Dequantize the GGUF tensor types a small Llama ships in: F32, F16, BF16, Q8_0, Q4_0, Q4_1.

A quantized GGUF tensor is a run of fixed-size *blocks*, each covering 32 consecutive weights
of one row (rows are the last, fastest dimension; 32 always divides them). A block starts
with its fp16 scale (and, for Q4_1, an fp16 minimum), then the packed integers:

    Q8_0  34 bytes = d (fp16) | 32 x int8 q                      w = d * q
    Q4_0  18 bytes = d (fp16) | 16 bytes, two 4-bit q per byte    w = d * (q - 8)
    Q4_1  20 bytes = d (fp16) | m (fp16) | 16 bytes of 4-bit q    w = d * q + m

In the 4-bit types byte j holds weight j in its low nibble and weight j + 16 in its high one.
Q4_0 is symmetric INT4 (the zero point is fixed at 8); Q4_1 is group-wise *asymmetric* INT4 at
group size 32, chapter 06's scheme: a scale d and a minimum m per group of 32 weights, q in
0..15. F16 and BF16 are plain half floats (BF16 = the top 16 bits of an fp32).

Everything is vectorised over all blocks at once, and each formula is evaluated in fp32 in
the order above, so the result equals the `gguf` package's reference dequantizer
(`gguf.quants.dequantize`) bit for bit (tests/test_gguf.py checks it on the real file).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

BLOCK = 32  # weights per block in every quantized type here
_BLOCK_BYTES = {QType.Q8_0: 34, QType.Q4_0: 18, QType.Q4_1: 20}
SUPPORTED = (QType.F32, QType.F16, QType.BF16, *_BLOCK_BYTES)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 2] bytes -> [n_blocks, 1] fp32: a little-endian fp16 per block."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 16] bytes -> [n_blocks, 32] values 0..15: low nibbles, then high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1).float()


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """An fp32 tensor of `shape` (torch order) from a GGUF tensor's raw `data`, as
    `gguf.GGUFReader` maps it (any dtype: only its bytes are read)."""
    qtype = QType(qtype)
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy())
    if qtype == QType.F32:
        return raw.view(torch.float32).reshape(shape)
    if qtype == QType.F16:
        return raw.view(torch.float16).float().reshape(shape)
    if qtype == QType.BF16:
        return raw.view(torch.bfloat16).float().reshape(shape)  # exact: bf16 -> fp32 pads zeros
    if qtype not in _BLOCK_BYTES:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(
            f"GGUF tensor type {qtype.name} is not dequantized by minillm (it reads {names}): "
            "re-quantize the model to one of those with llama.cpp's llama-quantize"
        )
    blocks = raw.reshape(-1, _BLOCK_BYTES[qtype])
    d = _fp16(blocks[:, 0:2])
    if qtype == QType.Q8_0:
        w = d * blocks[:, 2:].contiguous().view(torch.int8).float()
    elif qtype == QType.Q4_0:
        w = d * (_nibbles(blocks[:, 2:]) - 8)
    else:  # Q4_1
        w = d * _nibbles(blocks[:, 4:]) + _fp16(blocks[:, 2:4])
    return w.reshape(shape)
