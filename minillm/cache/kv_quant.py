"""Quantized K/V storage: chapter 06's formats applied to the cache (vLLM's `kv_cache_dtype`).

At long context the KV cache, not the weights, is what limits how many requests fit
(chapter 07), and a decode step reads all of it. Storing K and V in 8 bits instead of 16
halves both. The model still computes in its own dtype: a cache writes each new token's
K/V as codes plus scales and dequantizes what attention reads.

Scales: one per token and kv head, the absmax of that head's `head_dim` values (dynamic,
computed as the token is written, so no calibration run is needed). A token's K/V are
written once and never rescaled, which is what makes per-token scales fit a cache that
grows token by token; a per-channel K scale (KIVI's choice for the keys, whose outliers
sit in fixed channels) would need every past token requantized when the scale grows.
The scales are fp32: 4 bytes per head_dim codes, 6% on top of int8 codes at head_dim 64.

- `int8`: symmetric, round to nearest, codes in [-127, 127];
- `fp8` / `fp8_e4m3`: float8 e4m3 (3 mantissa bits, max 448): the format vLLM's fp8 cache uses;
- `fp8_e5m2`: float8 e5m2 (2 mantissa bits, max 57344): more range, coarser steps.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class KVQuant:
    """Quantize K/V along the last dimension (head_dim) with one fp32 scale per vector."""

    def __init__(self, name: str) -> None:
        if name not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={name!r}: use 'auto' (the model's dtype) or one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        self.name, self.dtype = name, KV_CACHE_DTYPES[name]
        self.is_int = not self.dtype.is_floating_point
        self.qmax = 127.0 if self.is_int else torch.finfo(self.dtype).max

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., d] -> (codes [..., d] in `dtype`, scales [..., 1] fp32): x ~ codes * scale."""
        x = x.float()
        # A vector of zeros (padding) gets scale 1, not 0: its codes are 0 either way.
        scale = x.abs().amax(-1, keepdim=True) / self.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = x / scale
        if self.is_int:
            y = y.round().clamp(-self.qmax, self.qmax)
        return y.to(self.dtype), scale

    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return (codes.float() * scale).to(dtype)

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes one token's K (or V) of one kv head takes: codes plus its fp32 scale."""
        return head_dim * self.dtype.itemsize + 4


def kv_quant(kv_cache_dtype: str) -> KVQuant | None:
    """None for "auto" (store K/V in the model's dtype), else the quantizer."""
    return None if kv_cache_dtype == "auto" else KVQuant(kv_cache_dtype)
