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
import torch.nn.functional as F

from minillm.cache.protocol import ModelShape
from minillm.kernels.paged_attention import gather_kv


class PagedKVCache:
    """The K/V pool [layers, num_blocks, block_size, kv_heads, head_dim], usable as the
    model's `cache=`: call `set_tables` with each batch row's block table before a
    forward; `update` writes through the tables and returns K/V gathered through them."""

    def __init__(
        self,
        cfg: ModelShape,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        use_kernel: bool = False,
    ) -> None:
        # use_kernel: the model calls `attention` instead of `update` + SDPA, so decode
        # steps run the Triton paged kernel (needs CUDA, or TRITON_INTERPRET=1 on a CPU).
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
        """Store k, v and attend (q [B, heads, T, head_dim] -> same shape): a decode step
        (T == 1) runs the Triton paged kernel, reading K/V in place; a prefill gathers and
        runs SDPA. The model calls it when `use_kernel` is set; Triton must be importable."""
        if q.shape[2] != 1:
            k_all, v_all = self.update(layer, k, v, positions)
            mask = self.causal_mask(positions)
            return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
        from minillm.kernels.paged_attention import paged_attention  # imports triton

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
