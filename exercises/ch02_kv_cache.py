"""Chapter 02 exercises: what a KV cache costs, a cache that stays small, a cache that forks.

Notebook 02 adds `minillm/cache/contiguous.py`: every token's keys and values, written once
at the token's position in a buffer [layers, batch, kv_heads, max_len, head_dim]
and read by every later step. Here you size such a cache, bound it, and split it:

    kv_cache_bytes      how much memory a cache needs, from an HF config.json
    cache_update        write a step's K and V into the buffer, each row at its positions
    decode_step         one cached generation step: one token per row, its position
    SlidingWindowCache  a ring buffer of the last `window` tokens (Mistral-style
                        sliding-window attention): memory O(window), not O(length)
    fork_cache          copy and reorder a cache's rows, for n samples of one
                        prompt and for beam search

`minillm.model.Transformer` accepts any object as its `cache=` with one method, the
cache protocol (`minillm.cache.protocol.Cache`; the model never looks inside):

    attention(layer, q, k, v, positions) -> out     called by each layer in order 0, 1, ...;
                                                    k, v [B, kv_heads, T, head_dim] are this
                                                    step's, to store; out [B, heads, T,
                                                    head_dim] is q attending over the cache

`KVCache` writes it as two methods, and so does `SlidingWindowCache` (its `attention` is
written for you):

    causal_mask(positions [B, T]) -> bool [B, 1, T, S]   (True = attend), before the write
    update(layer, k, v, positions) -> (k_all, v_all)     k_all, v_all [B, kv_heads, S,
                                                         head_dim] are what q attends to

so `SlidingWindowCache` plugs into the model unchanged. Replace each
`raise NotImplementedError(...)` with your code, in plain torch. Grade them with

    make grade CH=02    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch02

and one exercise with `-k "ch02 and sliding_window"`. The answers are in
`solutions/ch02_kv_cache.py`: try first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def kv_cache_bytes(config: dict[str, Any], tokens: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes a KV cache needs for `batch` sequences of `tokens` tokens each.

    Every layer stores one key and one value vector per kv head per token:

        bytes = 2 * num_hidden_layers * num_key_value_heads * head_dim
                  * tokens * batch * bytes_per_element(dtype)

    Llama-3-8B (32 layers, 8 kv heads, head_dim 128) in bf16: 2 * 32 * 8 * 128 * 2
    = 131072 bytes = 128 KiB per token, so one 8192-token sequence needs 1 GiB, and
    a batch of 64 of them more memory than the 16 GB of weights. That is why
    serving systems care about the cache more than about the model.

    Args:
        config: an HF `config.json` as a dict, with at least `num_hidden_layers`,
            `num_attention_heads`, `hidden_size`; maybe `num_key_value_heads` and
            `head_dim`.
        tokens: tokens per sequence (prompt and generated).
        batch: number of sequences.
        dtype: the cache's element type (`torch.bfloat16` etc.; `dtype.itemsize`
            gives its size in bytes).

    Returns:
        The number of bytes, an int (what `minillm.cache.contiguous.KVCache(...).nbytes` holds
        for a cache of that many slots).

    Pitfalls: the cache stores the *kv* heads, not the query heads (grouped-query
    attention: Llama-3-8B has 32 query heads but caches 8, a quarter of the memory
    multi-head attention would need). A config without `num_key_value_heads` is
    multi-head attention (kv heads = query heads). A config may give `head_dim`
    explicitly, and then it need not be hidden_size / num_attention_heads (Qwen3,
    Gemma): use it when present. Don't forget the factor 2 (K *and* V).
    """
    raise NotImplementedError("ch02: implement kv_cache_bytes")


def cache_update(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Write this step's keys and values into one layer's preallocated cache, in place.

    The buffers hold every token's K and V at the slot of its position: row b's token at
    position p lives in slot p of row b. A prefill writes T tokens per row at once; a
    decode step writes one (T = 1), each row at its own position, because the rows of a
    batch have different lengths:

        cache_k[b, :, positions[b, t]] = k[b, :, t]      for every b, t   (same for v)

    Args:
        cache_k, cache_v: one layer's buffers [B, kv_heads, max_len, head_dim] (a view of
            `KVCache.k[layer]`: write into them, do not rebind them).
        k, v: this step's keys and values [B, kv_heads, T, head_dim].
        positions: the tokens' positions [B, T] (long), e.g. [[5], [2]] for a decode step
            of two rows of lengths 5 and 2.

    Returns:
        None: the buffers change in place; every other slot keeps what it held.

    Pitfalls: `cache_k[:, :, pos] = k` writes every row at the same slots; indexing dims
    0 and 2 with index tensors of shape [B, T] selects a [B, T, kv_heads, head_dim] block
    (the indexed dims come first), so transpose k to match; the cache may store another
    dtype than k (cast); a loop over b and t is right but slow.
    """
    raise NotImplementedError("ch02: implement cache_update")


def decode_step(
    model: Any, cache: Any, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One cached generation step: the next-token logits of every row, one token each.

    After the prefill the cache holds every prompt token's K and V. A decode step runs the
    model on the last sampled token of each row only, at that token's position, and the
    model's attention reads everything else from the cache (each layer writes the new
    token's K/V at its position first):

        cache.kv_len = longest row so far (this token included)
        logits = model(tokens as [B, 1], positions as [B, 1], cache=cache)   # [B, 1, vocab]

    Args:
        model: a `minillm.model.Transformer` (any model with that call signature).
        cache: a `minillm.cache.KVCache` filled up to each row's position (its `kv_len`
            is how many slots attention reads: slots past a row's position are masked).
        tokens: the token of each row to feed [B] (long).
        positions: each token's position [B] (long): row b's length before this token.

    Returns:
        logits [B, vocab] of the token after each row's `tokens[b]`.

    Pitfalls: feed one token per row, not the sequence (that is `generate_naive`);
    positions are per row, and the rows' lengths differ; `kv_len` must cover the longest
    row's new slot (max(positions) + 1), and need not be `max_len` (fewer slots read);
    run under `torch.inference_mode()` (no autograd graph for generation).
    """
    raise NotImplementedError("ch02: implement decode_step")


class SlidingWindowCache:
    """A KV cache that keeps only the last `window` tokens: sliding-window attention.

    In sliding-window attention (Mistral 7B v0.1, window 4096; Gemma 2 on every
    other layer, Gemma 3 on five layers of six) a query at position p attends
    only to positions

        max(0, p - window + 1) .. p                  (itself included: `window` keys)

    instead of 0 .. p. Whatever is older is never read again, so the cache needs
    `window` slots, not one per token: memory O(window) however long the text
    (information still flows further back, one window per layer, through the
    hidden states). Store the token at position p in slot

        slot = p % window                             (a ring buffer)

    so that writing position p overwrites position p - window, the first one no
    query from p on may see. The slots are then in no particular order, but
    attention does not care about order: RoPE already rotated each key by its own
    position, and the mask says which slots a query may see.

    The model calls `attention(layer, q, k, v, positions)` in each layer (written
    below: it builds `causal_mask(positions)`, then calls `update(layer, ...)`).
    `positions` [B, T] hold, per row, the next T positions of that sequence,
    consecutive and continuing where the last call stopped (a prompt from 0, a
    decode step with T = 1, or a chunk of any length in between).
    Every row's tokens are real: no right padding.

    A step with T > 1 tokens (a prompt, a chunk) must work for any T, also
    T > window. The trap: writing all T tokens first and attending afterwards
    overwrites keys that the step's *own* early queries still need (with window 4,
    a 6-token prompt writes position 4 over position 0, which query 3 needs). The
    reference's way out: `update` returns the ring as it was *before* this step,
    followed by the step's own T keys (S = window + T keys), and only then writes
    the step's last `window` tokens into the ring; `causal_mask` returns the
    matching [B, 1, T, window + T] mask. To know which position each slot holds,
    keep a small [batch, window] tensor of positions (-1 for an empty slot) and
    update it once per step (in the last layer's `update`: that layer's mask was
    built just before it). Any other correct scheme passes the tests.

    Attributes/properties the tests use:
        nbytes: bytes of the K and V storage, 2 * num_layers * batch * kv_heads *
            window * head_dim * dtype.itemsize, the same after 10 tokens as after
            10,000.

    Pitfalls: off by one in the band (the query sees `window` positions counting
    itself, not window + 1); an empty slot (zeros at the start) must be masked,
    not attended to; slot = p % window, not the number of tokens in this call;
    a prompt longer than the window.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        window: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        """Allocate K and V buffers [num_layers, batch, kv_heads, window, head_dim] of
        `dtype` on `device` (zeros), plus whatever bookkeeping you need to know which
        position each slot holds. Nothing may grow with the sequence length later.

        Raises:
            ValueError: if window < 1.
        """
        raise NotImplementedError("ch02: implement SlidingWindowCache.__init__")

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V buffers (`tensor.nbytes` of each, added)."""
        raise NotImplementedError("ch02: implement SlidingWindowCache.nbytes")

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The cache protocol the model calls in every layer (`minillm.cache.protocol.Cache`),
        written for you: the mask first (it describes the ring as it was before this step),
        then the update, then attention over the S keys it returned."""
        mask = self.causal_mask(positions)
        k_all, v_all = self.update(layer, k, v, positions)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """The attention mask of this step, bool [B, 1, T, S] (True = attend).

        Called before any layer's `update` of this step, with positions [B, T]. Key
        column s must be True exactly when the key that `update` will return in column
        s holds a position q with  p - window < q <= p  for the query at position p
        (row t of the mask), and False for empty slots. S must equal the number of keys
        `update` returns (window + T in the reference's scheme).
        """
        raise NotImplementedError("ch02: implement SlidingWindowCache.causal_mask")

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys and values and return what the step attends to.

        Args:
            layer: which layer's buffers (0 .. num_layers - 1; called in that order).
            k, v: this step's keys and values [B, kv_heads, T, head_dim], RoPE applied.
            positions: [B, T], the positions of these tokens.

        Returns:
            k_all, v_all [B, kv_heads, S, head_dim], in the cache's dtype, whose columns
            match `causal_mask`'s. In the reference: the layer's ring *before* this
            step, then k (and v). Afterwards, slot position % window of row b holds
            the step's last `window` tokens of that row.
        """
        raise NotImplementedError("ch02: implement SlidingWindowCache.update")


def fork_cache(cache: Any, parent_rows: list[int] | torch.Tensor) -> Any:
    """A new cache whose row i continues the sequence of row parent_rows[i] of `cache`.

    Parallel sampling (n answers to one prompt): prefill the prompt once in a
    1-row cache, then fork it with parent_rows = [0] * n and decode n different
    tokens per step, saving n - 1 prefills. Beam search: each step keeps the
    best `beam_width` (sequence, next token) pairs; the kept sequences' caches
    are rows parent_rows of the old cache, some kept twice, some dropped:
    parent_rows = [2, 0, 2, 1] makes rows 0 and 2 of the new cache copies of old
    row 2. (Hugging Face's `_reorder_cache(past, beam_idx)` is this.)

        new.k[:, i] = cache.k[:, parent_rows[i]]     (and v; every layer, head, slot)

    Args:
        cache: a `minillm.cache.contiguous.KVCache`: tensors `cache.k` and `cache.v` of
            layout [layers, batch, kv_heads, max_len, head_dim]; other attributes
            (e.g. `kv_len`) must carry over unchanged.
        parent_rows: [new_batch] row indices into `cache` (a list or a long tensor),
            repeats allowed; new_batch may differ from the old batch.

    Returns:
        An object of the same class as `cache` (hint: `copy.copy`) with new `k`
        and `v` [layers, new_batch, kv_heads, max_len, head_dim]. `cache` itself
        is not modified: it may still serve other requests (a shared prompt).

    Raises:
        ValueError: if parent_rows is empty or holds an index outside
            0 .. batch - 1.

    Pitfalls: batch is dim 1, not dim 0 (dim 0 is the layer); the rows must own
    their memory: `cache.k.expand(...)` or a shared view makes the forked rows
    one tensor in disguise, so decoding different tokens into them writes each
    other's slots (or the original's). Advanced indexing and `index_select`
    copy; `expand` and basic slicing do not.
    """
    raise NotImplementedError("ch02: implement fork_cache")
