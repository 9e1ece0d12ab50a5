"""The paged K/V pool the model runs on (chapter 07), for batches that mix decode steps and
prompt chunks in one forward (chapter 08).

`PagedKVCache` holds K and V for every block of a `BlockManager`'s pool and plugs into
`minillm.model.Transformer` as its `cache=`. A step's tokens go into the model as ONE row,
`[1, N]`: first one token per decoding sequence, then each prompt chunk in turn (the
layout vLLM V1 uses). Every linear layer then reads its weights once for all of them. Only
attention needs to know which tokens belong together, and `plan` tells the cache whose each
token is (the decode rows' block tables, then each prompt chunk's table and length). The
rest follows from the positions the model passes to `attention`, as for any cache:

- each token's slot, where its K/V are written: its block (its sequence's table at
  position // block_size) and the offset in it;
- what it attends to: its sequence's tokens up to its own position. Decode rows are
  attended in place by the Triton paged kernel (`use_kernel=True`) or, fp32 on a CPU, by
  minillm's C one (`minillm.kernels.rowops.paged_attention`), else by gathering their
  blocks for SDPA; each prompt chunk's queries attend to the sequence's cached tokens and
  to the chunk's own, causally, on gathered K/V.

A second, CPU pool (`num_swap_blocks`) is where a preempted sequence's blocks can be
swapped to (`swap`). `kv_cache_dtype="int8"` or `"fp8"` stores codes and per-token scales
(`minillm.cache.kv_quant`), dequantized as they are gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.cache.kv_quant import kv_quant
from minillm.cache.protocol import ModelShape, grouped_sdpa
from minillm.kernels import rowops
from minillm.kernels.paged_attention import gather_kv, paged_attention


def _tables(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one tensor [rows, widest], padded with -1."""
    width = max(len(t) for t in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, t in enumerate(rows):
        out[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return out.to(device)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """SDPA of q [rows, heads, T, d] over each row's gathered K/V [rows, kv_heads, S, d];
    query t of row r sees the row's first visible[r] tokens (decode: the context length)
    or visible[r, t] (a chunk: its position + 1)."""
    slots = torch.arange(k.shape[2], device=q.device)
    if visible.dim() == 1:  # one length per row: the same for all its queries
        visible = visible[:, None]
    mask = slots < visible[:, None, :, None]  # [rows, 1, T or 1, S]
    return grouped_sdpa(q, k, v, mask)


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
        kv_cache_dtype: str = "auto",
    ) -> None:
        # use_kernel: decode rows attend with the Triton paged kernel, reading K/V in place
        # (needs CUDA, or Triton's CPU interpreter: see `minillm.kernels`).
        self.quant = kv_quant(kv_cache_dtype)
        if use_kernel and self.quant is not None:
            raise ValueError(
                f"the Triton paged kernel reads K/V in the model's dtype, not {kv_cache_dtype}: "
                "use use_kernel=False with a quantized cache (the gather path dequantizes)"
            )
        self.use_kernel = use_kernel
        # One block more than the manager hands out: padding rows of a static decode plan
        # write and read there, never into a sequence's blocks.
        self.padding_block = num_blocks
        shape = (cfg.num_hidden_layers, num_blocks + 1, block_size, cfg.num_key_value_heads)
        shape += (cfg.head_dim,)
        store = dtype if self.quant is None else self.quant.dtype
        scale_shape = (*shape[:-1], 1 if self.quant else 0)  # empty when not quantized
        # Pools of codes and of their scales; each is copied, swapped and gathered alike.
        self.pools = [torch.zeros(shape, dtype=store, device=device) for _ in "kv"]
        self.pools += [torch.ones(scale_shape, device=device) for _ in "kv"]
        self.k, self.v, self.k_scale, self.v_scale = self.pools
        pin = torch.device(device).type == "cuda"  # page-locked: copies overlap and run faster
        self.swap_pools = [
            torch.zeros((p.shape[0], num_swap_blocks, *p.shape[2:]), dtype=p.dtype, pin_memory=pin)
            for p in self.pools
        ]
        self.block_size = block_size
        self._static: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.plan([], [])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def plan(
        self, decode: Sequence[Sequence[int]], chunks: Sequence[tuple[Sequence[int], int]]
    ) -> None:
        """The next forward's rows, in the order of its tokens: one token for each `decode`
        row (its block table), then each prompt chunk's (block table, number of tokens).
        Where a token's K/V go and what it attends to follow from its position, which the
        model hands to `attention`: the plan says only whose each token is."""
        device = self.k.device
        rows = [
            *range(len(decode)),
            *(len(decode) + i for i, (_, n) in enumerate(chunks) for _ in range(n)),
        ]
        self.token_rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.tables = _tables([*decode, *(t for t, _ in chunks)] or [[0]], device)
        self.num_decode = len(decode)  # their tables as wide as the widest of them alone
        self.decode_tables = self.tables[: len(decode), : max(map(len, decode), default=0)]
        self.chunks = [  # each chunk gathers its own blocks only
            (self.tables[len(decode) + i : len(decode) + i + 1, : len(t)], n)
            for i, (t, n) in enumerate(chunks)
        ]

    def plan_static_decode(
        self, decode: Sequence[Sequence[int]], rows: int, max_blocks: int
    ) -> None:
        """A decode-only step padded to `rows` rows, its tables written into a buffer that
        keeps its address from step to step, so that a CUDA graph recorded once (or a
        compiled step) can replay it: padding rows (position 0) attend to one slot of the
        padding block."""
        if len(decode) > rows:
            raise ValueError(f"{len(decode)} decode rows do not fit a plan of {rows}")
        key = (rows, max_blocks)  # one set of buffers per shape, kept for its recording
        if key not in self._static:
            device = self.k.device
            self._static[key] = {
                "tables": torch.zeros(rows, max_blocks, dtype=torch.long, device=device),
                "rows": torch.arange(rows, device=device),
            }
        static = self._static[key]
        tables = torch.full((rows, max_blocks), self.padding_block, dtype=torch.long)
        for i, table in enumerate(decode):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        static["tables"].copy_(tables, non_blocking=True)
        self.tables, self.token_rows = static["tables"], static["rows"]
        self.decode_tables = self.tables
        self.num_decode, self.chunks = rows, []

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Each token's slot in the pool [N]: its block (its row's table at position //
        block_size) and the offset in it (position % block_size)."""
        bs = self.block_size
        return self.tables[self.token_rows, positions // bs] * bs + positions % bs

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy every layer's K/V of block src into block dst."""
        for src, dst in pairs:
            for pool in self.pools:
                pool[:, dst] = pool[:, src]

    def swap(self, pairs: Sequence[tuple[int, int]], out: bool) -> None:
        """Copy blocks device -> CPU pool (`out`), or CPU pool -> device: (src, dst) pairs."""
        for src, dst in pairs:
            for pool, swap_pool in zip(self.pools, self.swap_pools, strict=True):
                if out:
                    swap_pool[:, dst].copy_(pool[:, src], non_blocking=True)
                else:
                    pool[:, dst].copy_(swap_pool[:, src], non_blocking=True)
        if pairs and self.k.is_cuda:
            torch.cuda.current_stream().synchronize()  # the CPU pool is reused at once

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Write this step's k, v [1, kv_heads, N, d] at the slots their positions [1, N]
        give, then attend: decode rows (seeing positions up to their own) through the paged
        kernel or a gather, each chunk causally on its row's gathered K/V."""
        if q.shape[0] != 1 or q.shape[2] != self.token_rows.numel():
            raise ValueError(
                f"q {tuple(q.shape)} does not match the plan ({self.token_rows.numel()} "
                "tokens in one row): call plan() before the forward"
            )
        seen = positions[0] + 1  # each query sees the row's tokens up to its own position
        self.write(layer, self.slots(positions[0]), k[0].transpose(0, 1), v[0].transpose(0, 1))
        outs, n = [], self.num_decode
        if n:
            q_dec = q[0, :, :n].transpose(0, 1)  # [n, heads, d]
            tables, lens = self.decode_tables, seen[:n]
            if self.use_kernel:
                out = paged_attention(q_dec, self.k[layer], self.v[layer], tables, lens)
            else:  # in place in C (fp32 CPU, unquantized), else a gather and SDPA
                out = (
                    None
                    if self.quant
                    else rowops.paged_attention(q_dec, self.k[layer], self.v[layer], tables, lens)
                )
                if out is None:
                    k_rows, v_rows = self.gather(layer, tables, q.dtype)
                    out = attend(q_dec[:, :, None], k_rows, v_rows, lens)[:, :, 0]
            outs.append(out.transpose(0, 1)[None])  # [1, heads, n, d]
        offset = n
        for table, length in self.chunks:
            q_chunk = q[:, :, offset : offset + length]
            visible = seen[None, offset : offset + length]
            outs.append(attend(q_chunk, *self.gather(layer, table, q.dtype), visible))
            offset += length
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's k, v [N, kv_heads, d] at `slots` (quantized, if the cache is)."""
        k_pool, v_pool = self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)
        if self.quant is None:
            k_pool[slots] = k.to(k_pool.dtype)
            v_pool[slots] = v.to(v_pool.dtype)
            return
        k_scales, v_scales = self.k_scale[layer].flatten(0, 1), self.v_scale[layer].flatten(0, 1)
        k_pool[slots], k_scales[slots] = self.quant.quantize(k)
        v_pool[slots], v_scales[slots] = self.quant.quantize(v)

    def gather(
        self, layer: int, tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of each row's blocks, contiguous [rows, kv_heads, S, d], in `dtype`."""
        k, v = gather_kv(self.k[layer], tables), gather_kv(self.v[layer], tables)
        if self.quant is None:
            return k, v
        k_scale, v_scale = (
            gather_kv(self.k_scale[layer], tables),
            gather_kv(self.v_scale[layer], tables),
        )
        return self.quant.dequantize(k, k_scale, dtype), self.quant.dequantize(v, v_scale, dtype)
