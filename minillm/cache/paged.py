"""The paged K/V pool the model runs on (chapter 07).

`PagedKVCache` holds K and V for every block of a `BlockManager`'s pool and plugs into
`minillm.model.Transformer` as its `cache=`: before a forward, `set_tables` gives it each
batch row's block table; the model's K/V are then written through the tables, and read
back either gathered into contiguous tensors (PyTorch) or in place by the Triton paged
decode kernel (`use_kernel=True`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.cache.protocol import ModelShape, SdpaCache
from minillm.kernels.paged_attention import gather_kv, paged_attention


class PagedKVCache(SdpaCache):
    """The K/V pool [layers, num_blocks, block_size, kv_heads, head_dim], usable as the
    model's `cache=`: call `set_tables` with each batch row's block table before a
    forward; the model's `attention` calls then write and read through the tables."""

    def __init__(
        self,
        cfg: ModelShape,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        use_kernel: bool = False,
    ) -> None:
        # use_kernel: decode steps attend with the Triton paged kernel, reading K/V in place
        # (needs CUDA, or Triton's CPU interpreter: see `minillm.kernels`).
        self.use_kernel = use_kernel
        shape = (
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.tables = torch.zeros(0, 0, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def set_tables(self, block_tables: Sequence[Sequence[int]]) -> None:
        """Block tables of the next forward's batch rows (padded internally)."""
        if not block_tables or not all(block_tables):
            raise ValueError("set_tables needs one non-empty block table per batch row")
        width = max(len(t) for t in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.long)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            tables[b, len(t) :] = -1
        self.tables = tables.to(self.k.device)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy every layer's K/V of block src into block dst."""
        for src, dst in pairs:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot of each (row, position) [B, T]; -1 past the row's table (padding)."""
        index = positions // self.block_size
        inside = index < (self.tables >= 0).sum(1, keepdim=True)
        block = self.tables.gather(1, index.clamp(max=self.tables.shape[1] - 1))
        return torch.where(inside, block * self.block_size + positions % self.block_size, -1)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, kv_heads, T, head_dim] at `positions` [B, T] through the block
        tables; return the rows' K/V gathered through them [B, kv_heads, S, head_dim]."""
        slots = self.slots(positions).flatten()
        keep = slots >= 0  # right-padding past a row's blocks is dropped
        kf, vf = self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)  # [slots, kvh, d]
        kf[slots[keep]] = k.transpose(1, 2).flatten(0, 1)[keep].to(kf.dtype)
        vf[slots[keep]] = v.transpose(1, 2).flatten(0, 1)[keep].to(vf.dtype)
        return gather_kv(self.k[layer], self.tables), gather_kv(self.v[layer], self.tables)

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v through the block tables and attend. With `use_kernel`, a decode step
        (one new token per row) runs the Triton paged kernel, which reads K/V in place;
        otherwise (and for prefills) K/V are gathered into contiguous tensors for SDPA."""
        if not (self.use_kernel and q.shape[2] == 1):
            return super().attention(layer, q, k, v, positions)
        slots = self.slots(positions).flatten()
        self.k[layer].flatten(0, 1)[slots] = k[:, :, 0].to(self.k.dtype)
        self.v[layer].flatten(0, 1)[slots] = v[:, :, 0].to(self.v.dtype)
        lens = positions[:, 0] + 1
        out = paged_attention(q[:, :, 0], self.k[layer], self.v[layer], self.tables, lens)
        return out[:, :, None]

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, T, S]: a query at position p sees logical slots 0..p of its row."""
        slots = torch.arange(self.tables.shape[1] * self.block_size, device=positions.device)
        return (slots <= positions[..., None])[:, None]
