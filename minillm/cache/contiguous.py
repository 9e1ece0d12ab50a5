"""A contiguous, pre-allocated KV cache: chapter 02's fix for the O(n^2) naive loop.

Without a cache, generating token n re-computes the keys and values of all n-1
tokens before it. With one, each token's K and V are computed once, written into
a buffer at the token's position, and read back by every later step.

Layout: one buffer for K and one for V, [layers, batch, kv_heads, max_len, head_dim].
It stores the *kv* heads, not the query heads they serve (grouped-query attention),
so a model with 9 query heads and 3 kv heads caches a third of what multi-head
attention would.

Sequences of different lengths share the buffer without padding masks: sequence b's
token at position p lives in slot p of row b, and a query at position p attends to
slots 0..p of its row. Slots past a sequence's end may hold junk (from padding in a
batched prefill) but are never read before being overwritten by the real token.

`kv_cache_dtype="int8"` or `"fp8"` stores codes and per-token scales instead
(`minillm.cache.kv_quant`); `update` then returns the window dequantized to the model's dtype.
"""

from __future__ import annotations

import torch

from minillm.cache.kv_quant import kv_quant
from minillm.cache.protocol import ModelShape, SdpaCache, grouped_sdpa
from minillm.kernels import rowops


class KVCache(SdpaCache):
    """Per-layer K/V buffers for `batch_size` sequences of up to `max_len` tokens.

    A decode step (one token a row) of fp32 CPU tensors, with the cache's default attention
    (`grouped_sdpa`), its own `update` and `decode_kernel` on, writes and attends in one C call
    (`minillm.kernels.rowops.decode_attention`: grouped SDPA's math, without the mask,
    the index writes and the kernel launch PyTorch spends per layer); anything else takes
    the PyTorch path below."""

    decode_kernel = True  # False: every step the PyTorch way (a benchmark's baseline)

    def __init__(
        self,
        cfg: ModelShape,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len} exceeds the model's context of "
                f"{cfg.max_position_embeddings} positions"
            )
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.quant = kv_quant(kv_cache_dtype)
        store = dtype if self.quant is None else self.quant.dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        scale_shape = (*shape[:-1], 1 if self.quant else 0)  # empty when not quantized
        self.k_scale = torch.ones(scale_shape, device=device)
        self.v_scale = torch.ones(scale_shape, device=device)
        # The buffers never move: tell torch.compile their addresses are fixed, so a compiled
        # step that writes into them can still be captured as a CUDA graph (otherwise inductor
        # skips CUDA graphs for "mutated inputs"; transformers' StaticCache does the same).
        for buffer in (self.k, self.v, self.k_scale, self.v_scale):
            torch._dynamo.mark_static_address(buffer)
        # How many slots attention reads. Generation lowers it to the longest sequence so
        # far (less work per step); a compiled step keeps max_len (fixed shapes).
        self.kv_len = max_len

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes allocated: 2 x layers x batch x kv_heads x max_len x head_dim x dtype size
        (plus the scales when quantized)."""
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, kv_heads, T, head_dim] at `positions` [B, T]; return the layer's
        first `kv_len` slots of K and V [B, kv_heads, kv_len, head_dim], in k's dtype."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1] against [B, T]
        window = (layer, slice(None), slice(None), slice(None, self.kv_len))
        if self.quant is None:
            self.k[layer][rows, :, positions] = k.transpose(1, 2).to(self.k.dtype)
            self.v[layer][rows, :, positions] = v.transpose(1, 2).to(self.v.dtype)
            return self.k[window], self.v[window]
        out = []
        for new, codes, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = self.quant.quantize(new.transpose(1, 2))  # [B, T, kv_heads, d], [.., 1]
            codes[layer][rows, :, positions], scales[layer][rows, :, positions] = q, scale
            out.append(self.quant.dequantize(codes[window], scales[window], k.dtype))
        return out[0], out[1]

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        own = type(self).update is KVCache.update  # a subclass's update (an exercise's) runs
        if self.decode_kernel and own and self.quant is None and self.sdpa is grouped_sdpa:
            out = rowops.decode_attention(
                self.k[layer], self.v[layer], q, k, v, positions, self.kv_len
            )
            if out is not None:
                return out
        return super().attention(layer, q, k, v, positions)

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, kv_len]: a query at position p sees slots 0..p of its row."""
        slots = torch.arange(self.kv_len, device=positions.device)
        return (slots <= positions[..., None])[:, None]
