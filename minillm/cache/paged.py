"""The paged K/V pool the model runs on (chapter 07), for batches that mix decode steps and
prompt chunks in one forward (chapter 08).

`PagedKVCache` holds K and V for every block of a `BlockManager`'s pool and plugs into
`minillm.model.Transformer` as its `cache=`. A step's tokens go into the model as ONE row,
`[1, N]`: first one token per decoding sequence, then each prompt chunk in turn (the
layout vLLM V1 uses). Every linear layer then reads its weights once for all of them. Only
attention needs to know which tokens belong together, and `plan` tells the cache:

- each token's slot (its block through its sequence's table, and the offset in it), where
  its K/V are written;
- the decode rows (table, context length): attended by the Triton paged kernel in place
  (`use_kernel=True`), or by gathering their blocks for SDPA;
- the prompt chunks (table, first position, length): each chunk's queries attend to the
  sequence's cached tokens and to the chunk's own, causally, on gathered K/V.

A second, CPU pool (`num_swap_blocks`) is where a preempted sequence's blocks can be
swapped to (`swap`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minillm.cache.protocol import ModelShape
from minillm.kernels.paged_attention import gather_kv, paged_attention


def _tables(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one tensor [rows, widest], padded with -1."""
    width = max(len(t) for t in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, t in enumerate(rows):
        out[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return out.to(device)


def gathered(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """The PyTorch read: SDPA of q [rows, heads, T, d] over each row's K/V gathered
    contiguous through its table; query t of row r sees the row's first visible[r] tokens
    (decode: the context length) or visible[r, t] (a chunk: its position + 1)."""
    k, v = gather_kv(k_pool, tables), gather_kv(v_pool, tables)  # [rows, kv_heads, S, d]
    slots = torch.arange(k.shape[2], device=q.device)
    if visible.dim() == 1:  # one length per row: the same for all its queries
        visible = visible[:, None]
    mask = slots < visible[:, None, :, None]  # [rows, 1, T or 1, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class PagedKVCache:
    """The K/V pool [layers, num_blocks, block_size, kv_heads, head_dim]: `plan` a step's
    decode rows and prompt chunks, then run the model on their tokens as one row."""

    def __init__(
        self,
        cfg: ModelShape,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        use_kernel: bool = False,
        num_swap_blocks: int = 0,
    ) -> None:
        # use_kernel: decode rows attend with the Triton paged kernel, reading K/V in place
        # (needs CUDA, or Triton's CPU interpreter: see `minillm.kernels`).
        self.use_kernel = use_kernel
        # One block more than the manager hands out: padding rows of a static decode plan
        # write and read there, never into a sequence's blocks.
        self.padding_block = num_blocks
        shape = (cfg.num_hidden_layers, num_blocks + 1, block_size, cfg.num_key_value_heads)
        shape += (cfg.head_dim,)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        swap_shape = (shape[0], num_swap_blocks, *shape[2:])
        pin = torch.device(device).type == "cuda"  # page-locked: copies overlap and run faster
        self.k_swap = torch.zeros(swap_shape, dtype=dtype, pin_memory=pin)
        self.v_swap = torch.zeros(swap_shape, dtype=dtype, pin_memory=pin)
        self.block_size = block_size
        self._static: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.plan([], [])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def plan(
        self,
        decode: Sequence[tuple[Sequence[int], int]],
        prefill: Sequence[tuple[Sequence[int], int, int]],
    ) -> None:
        """The next forward's layout: `decode` rows (block table, context length counting
        the new token), then `prefill` chunks (block table, first position, length)."""
        device, bs = self.k.device, self.block_size
        slots: list[int] = []
        for table, length in decode:
            slots.append(table[(length - 1) // bs] * bs + (length - 1) % bs)
        for table, start, length in prefill:
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + length)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        self.num_decode = len(decode)
        if decode:
            self.decode_tables = _tables([t for t, _ in decode], device)
            self.decode_lens = torch.tensor([n for _, n in decode], device=device)
        self.chunks = [(_tables([t], device), start, n) for t, start, n in prefill]

    def plan_static_decode(
        self, decode: Sequence[tuple[Sequence[int], int]], rows: int, max_blocks: int
    ) -> None:
        """A decode-only step padded to `rows` rows, written into buffers that keep their
        addresses from step to step, so that a CUDA graph recorded once (or a compiled step)
        can replay it: padding rows attend to one slot of the padding block."""
        if len(decode) > rows:
            raise ValueError(f"{len(decode)} decode rows do not fit a plan of {rows}")
        key = (rows, max_blocks)  # one set of buffers per shape, kept for its recording
        if key not in self._static:
            device = self.k.device
            self._static[key] = {
                "slots": torch.zeros(rows, dtype=torch.long, device=device),
                "tables": torch.zeros(rows, max_blocks, dtype=torch.long, device=device),
                "lens": torch.ones(rows, dtype=torch.long, device=device),
            }
        static = self._static[key]
        pad = self.padding_block
        bs = self.block_size
        tables = torch.full((rows, max_blocks), pad, dtype=torch.long)
        lens = torch.ones(rows, dtype=torch.long)
        slots = torch.full((rows,), pad * bs, dtype=torch.long)
        for i, (table, length) in enumerate(decode):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
            lens[i] = length
            slots[i] = table[(length - 1) // bs] * bs + (length - 1) % bs
        for name, value in (("slots", slots), ("tables", tables), ("lens", lens)):
            static[name].copy_(value, non_blocking=True)
        self.slot_mapping = static["slots"]
        self.decode_tables, self.decode_lens = static["tables"], static["lens"]
        self.num_decode, self.chunks = rows, []

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy every layer's K/V of block src into block dst."""
        for src, dst in pairs:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def swap(self, pairs: Sequence[tuple[int, int]], out: bool) -> None:
        """Copy blocks device -> CPU pool (`out`), or CPU pool -> device: (src, dst) pairs."""
        for src, dst in pairs:
            if out:
                self.k_swap[:, dst].copy_(self.k[:, src], non_blocking=True)
                self.v_swap[:, dst].copy_(self.v[:, src], non_blocking=True)
            else:
                self.k[:, dst].copy_(self.k_swap[:, src], non_blocking=True)
                self.v[:, dst].copy_(self.v_swap[:, src], non_blocking=True)
        if pairs and self.k.is_cuda:
            torch.cuda.current_stream().synchronize()  # the CPU pool is reused at once

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Write this step's k, v [1, kv_heads, N, d] at their planned slots, then attend:
        decode rows through the paged kernel or a gather, chunks on gathered K/V."""
        if q.shape[0] != 1 or q.shape[2] != self.slot_mapping.numel():
            raise ValueError(
                f"q {tuple(q.shape)} does not match the plan ({self.slot_mapping.numel()} "
                "tokens in one row): call plan() before the forward"
            )
        k_pool, v_pool = self.k[layer], self.v[layer]
        k_pool.flatten(0, 1)[self.slot_mapping] = k[0].transpose(0, 1).to(k_pool.dtype)
        v_pool.flatten(0, 1)[self.slot_mapping] = v[0].transpose(0, 1).to(v_pool.dtype)
        outs, n = [], self.num_decode
        if n:
            q_dec = q[0, :, :n].transpose(0, 1)  # [n, heads, d]
            if self.use_kernel:
                out = paged_attention(q_dec, k_pool, v_pool, self.decode_tables, self.decode_lens)
            else:
                pools = (k_pool, v_pool)
                out = gathered(q_dec[:, :, None], *pools, self.decode_tables, self.decode_lens)
                out = out[:, :, 0]
            outs.append(out.transpose(0, 1)[None])  # [1, heads, n, d]
        offset = n
        for table, start, length in self.chunks:
            q_chunk = q[:, :, offset : offset + length]
            positions = torch.arange(start, start + length, device=q.device)
            outs.append(gathered(q_chunk, k_pool, v_pool, table, positions[None] + 1))
            offset += length
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
