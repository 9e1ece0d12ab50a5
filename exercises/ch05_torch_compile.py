"""Chapter 05 exercise: the decode step that torch.compile captures once.

Notebook 05 shows why chapter 02's decode loop does not compile well: it lowers the
cache's length to the slots filled so far, so attention's score matrix [B, H, 1, n]
grows every token, dynamo guards on n and compiles again at every step (and reading
`positions.max()` into a Python int is a graph break). minillm's fix
(`minillm/generation/static.py`) keeps every shape fixed. Here you write its heart:

    static_attention   write this token's K/V at tensor positions into a fixed-size
                       cache and attend over all of its slots, the empty ones masked

The tests plug your function into minillm's Transformer as its cache, compile the decode
step with `fullgraph=True, dynamic=False` and a backend that counts graphs, decode
several tokens at growing positions and require exactly one graph, no recompile, and
the tokens of chapter 02's eager cached `generate`. Grade it with

    make grade CH=05    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch05

The answer is in `solutions/ch05_torch_compile.py`: try first.
"""

from __future__ import annotations

import torch


def static_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Store k, v in one layer's static cache at `positions`; return q's attention over it.

    Args:
        q: [B, heads, T, head_dim], the new tokens' queries (T = 1 when decoding, the
            prompt's length when prefilling).
        k, v: [B, kv_heads, T, head_dim], their keys and values; heads is a multiple of
            kv_heads (grouped-query attention: kv head j serves query heads
            j * heads / kv_heads ... (j + 1) * heads / kv_heads - 1).
        k_cache, v_cache: [B, kv_heads, max_len, head_dim], this layer's buffers. Write
            into them in place: slot p of row b holds the token at position p.
        positions: [B, T] long, each new token's position (rows may differ).

    Returns:
        [B, heads, T, head_dim]: for each query at position p of row b, softmax attention
        (scale 1 / sqrt(head_dim)) over slots 0..p of row b, which now include this
        step's own tokens.

    Pitfalls, each a recompile or a graph break once compiled:
      - do not slice the cache to the longest position (`k_cache[:, :, : n]` with n read
        from `positions`): its shape would change every step. Attend over all max_len
        slots and mask the ones past each query's position.
      - do not turn a position into a Python number (`int(...)`, `.item()`, `.tolist()`,
        `if` on a tensor): dynamo cannot keep it in the graph.
      - write with tensor indices (advanced indexing, `index_put_`, `scatter_`), so a new
        position is new data for the same graph.
    `torch.nn.functional.scaled_dot_product_attention` takes a bool mask (True = attend)
    and `enable_gqa=True` for the grouped heads.
    """
    raise NotImplementedError("ch05: implement static_attention")
