"""Chapter 01 exercises: the small pieces of a Llama-style decoder, and top-p.

Notebook 01 builds the decoder in `minillm/model/transformer.py`. Here you write its
building blocks yourself, plus two the chapter leaves to torch (grouped-query
head sharing, the causal mask) and the top-p sampler:

    rms_norm          the normalisation before attention and the MLP
    rope_frequencies  one rotation speed per channel pair
    apply_rotary      rotary position embedding (RoPE) on q or k
    repeat_kv         grouped-query attention: share each kv head
    gqa_attention     a layer's attention: RoPE, shared kv heads, causal softmax
    causal_mask       who may attend to whom, also when queries are a suffix
    top_p_filter      nucleus sampling's cut of the vocabulary

Replace each `raise NotImplementedError(...)` with your code, in plain torch.
Grade them with

    make grade CH=01    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch01

and one exercise with `-k "ch01 and rms_norm"`. The answers are in
`solutions/ch01_basics.py`: try first.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, as Llama does it.

        rms(x) = sqrt(mean(x_i ** 2 over the last dim) + eps)
        y      = weight * (x / rms(x))

    Unlike LayerNorm there is no mean subtraction and no bias: each vector is
    only rescaled to unit RMS, then every channel is scaled by its learned gain.

    Args:
        x: activations [..., dim], any float dtype (fp32, fp16, bf16).
        weight: the learned gain [dim], broadcast over the leading dims.
        eps: added to the mean of squares *inside* the square root, so an
            all-zero vector gives zeros instead of 0/0 = nan.

    Returns:
        A tensor of the shape of x. Follow Llama's order exactly: normalise in
        fp32, cast the normalised vector back to x.dtype, then multiply by
        `weight` (so the result has the dtype torch's promotion of weight and x
        gives: x.dtype when weight has x's dtype, as in a half-precision model).

    Pitfall: do the sum of squares in fp32 (`x.float()`) even when x is fp16.
    In fp16, x ** 2 overflows to inf once |x| > 256 (fp16's largest value is
    65504) and underflows to 0 once |x| < ~2e-4, so half-precision arithmetic
    returns zeros, nans or vectors 1000x too large on perfectly normal inputs.
    """
    raise NotImplementedError("ch01: implement rms_norm")


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """The rotation speed of each channel pair in rotary position embedding.

        inv_freq[i] = 1 / theta ** (2 * i / head_dim)    for i = 0 .. head_dim/2 - 1

    Pair 0 turns by 1 radian per position; the last pair turns by about
    1/theta radian per position, so it takes ~2*pi*theta positions to come
    round. Fast pairs resolve nearby tokens, slow pairs far-apart ones.
    `theta` is `rope_theta` in an HF config.json: 10000 in Llama 2, 500000 in
    Llama 3.

    Args:
        head_dim: channels per attention head; must be even (they are paired).
        theta: the base of the geometric series of wavelengths.

    Returns:
        float32 tensor [head_dim // 2], decreasing from 1.0.

    Raises:
        ValueError: if head_dim is odd.

    Pitfall: compute the exponent in floating point. `torch.arange(0, d, 2) / d`
    is already float, but `2 * i // head_dim` (integer division) makes every
    exponent 0 and every frequency 1.
    """
    raise NotImplementedError("ch01: implement rope_frequencies")


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (RoPE), in Hugging Face's "rotate half" layout.

    Channel i is paired with channel i + head_dim/2 (not with i + 1), and the
    pair (a, b) at position m is rotated by the angle m * inv_freq[i]:

        a' = a * cos(m * inv_freq[i]) - b * sin(m * inv_freq[i])
        b' = b * cos(m * inv_freq[i]) + a * sin(m * inv_freq[i])

    Written on whole tensors, with x1, x2 the two halves of the last dim:

        x' = x * cos + cat(-x2, x1) * sin,   cos/sin = cos/sin(cat(angles, angles))

    Why it works: a rotation keeps each pair's length, and the dot product of
    q rotated to position m with k rotated to position n depends only on m - n,
    so attention scores see relative positions.

    Args:
        x: queries or keys [batch, heads, seq, head_dim].
        positions: integer positions [seq] (shared by the batch) or
            [batch, seq] (one row per sequence, e.g. left-padded prompts or a
            decode step at position 57). Position 0 leaves x unchanged.
        theta: as in `rope_frequencies`.

    Returns:
        A tensor of the shape and dtype of x.

    Pitfalls: the pairing (HF checkpoints permute q/k weights for this
    "rotate half" layout; the original paper's interleaved pairs (0,1), (2,3)
    give different numbers on the same weights); the broadcast of cos/sin
    [batch, seq, head_dim] against x [batch, heads, seq, head_dim] (insert the
    heads axis); angles must be computed in fp32 even when x is fp16, or
    positions above 2048 lose their integer precision.
    """
    raise NotImplementedError("ch01: implement apply_rotary")


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention (GQA): give each query head its shared kv head.

    A GQA model has fewer key/value heads than query heads (SmolLM2-135M: 9
    query heads, 3 kv heads), which shrinks the KV cache by that ratio. Query
    head h reads kv head h // n_rep, so consecutive query heads share:

        out[:, h] = x[:, h // n_rep]        n_rep = n_heads // n_kv_heads

    Args:
        x: keys or values [batch, n_kv_heads, seq, head_dim].
        n_rep: how many query heads share one kv head (>= 1).

    Returns:
        [batch, n_kv_heads * n_rep, seq, head_dim]; with n_rep == 1, x itself.
        kv heads 0, 1 with n_rep=2 become heads 0, 0, 1, 1.

    Pitfall: `x.repeat(1, n_rep, 1, 1)` tiles the heads as 0, 1, 0, 1, which
    pairs query heads with the wrong keys. `expand` + `reshape` (or
    `repeat_interleave` on dim 1) gives 0, 0, 1, 1; `expand` alone copies
    nothing. (torch's SDPA does this itself with `enable_gqa=True`, as
    `minillm/model/transformer.py` uses it.)
    """
    raise NotImplementedError("ch01: implement repeat_kv")


def gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """A decoder layer's attention: RoPE on q and k, grouped-query heads, causal softmax.

    What `minillm.model.transformer.Attention.forward` does between the projections
    and `o_proj`, written out instead of calling SDPA:

        q, k  <- rotate pairs (i, i + d/2):  x * cos + rotate_half(x) * sin,
                 rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])
        k, v  <- each kv head repeated for its n_rep = H // KV query heads (0,0,1,1)
        out   =  softmax(q k^T / sqrt(d), with -inf where key j > query i) v

    Args:
        q: queries [B, H, T, d], before RoPE.
        k: keys [B, KV, T, d], before RoPE; KV divides H.
        v: values [B, KV, T, d].
        cos, sin: the rotation tables [B, T, d] of the T positions (what
            `rope_cos_sin` returns: each angle written twice, for i and i + d/2).

    Returns:
        [B, H, T, d] in q's dtype: token i's output mixes the values of tokens 0..i.

    Pitfalls: cos/sin lack the heads axis (insert it); query head h reads kv head
    h // n_rep, not h % KV; scale by sqrt(head_dim), not sqrt(hidden size); do the
    arithmetic in fp32 (in fp16, q . k of large activations passes 65504 and the
    softmax returns nan).
    """
    raise NotImplementedError("ch01: implement gqa_attention")


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The boolean attention mask of a decoder: True where a query may attend.

    The q_len queries are the *last* q_len of the kv_len tokens (a prompt
    processed whole has q_len == kv_len; a decode step with a KV cache has
    q_len == 1; a prompt processed in chunks has anything in between). Query i
    sits at absolute position kv_len - q_len + i and may attend to every key
    j at or before it:

        mask[i, j] = j <= i + (kv_len - q_len)

    Args:
        q_len: number of query tokens (>= 1).
        kv_len: number of key/value tokens, the queries included (>= q_len).
        device: where to build the mask.

    Returns:
        bool tensor [q_len, kv_len] (True = attend), the convention of
        `torch.nn.functional.scaled_dot_product_attention(attn_mask=...)` and
        of `minillm.model.transformer.Transformer(mask=...)` (after adding [None, None]).

    Raises:
        ValueError: if q_len > kv_len.

    Pitfall: SDPA's `is_causal=True` aligns the triangle to the top-left, so
    with q_len < kv_len it masks keys the queries are entitled to see (a single
    decode query would see only key 0). Align to the bottom-right, as here.
    """
    raise NotImplementedError("ch01: implement causal_mask")


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus (top-p) filtering: keep the smallest set of likeliest tokens with mass >= p.

    Per row: sort the tokens by probability (softmax of the logits), walk down
    the list adding probabilities, and stop at the first token that brings the
    running total to >= p. That token is kept; everything after it is set to
    -inf, so softmax gives it probability 0 and sampling can never pick it.

        probs 0.5 0.2 0.15 0.1 0.05, p = 0.6  ->  keep 0.5 and 0.2 (mass 0.7)

    Equivalently: drop a token when the tokens ranked above it already sum to
    >= p. The most likely token is always kept, so a tiny p is greedy decoding.

    Args:
        logits: [..., vocab]; each row (all leading dims) is filtered on its
            own. May already hold -inf (e.g. after a top-k cut).
        p: in (0, 1]. p = 1 keeps every token.

    Returns:
        A new tensor like `logits`: kept entries unchanged (not renormalised),
        dropped entries -inf. The input is not modified.

    Raises:
        ValueError: unless 0 < p <= 1.

    Pitfalls: off by one (the token that crosses p is *in* the set); the
    scatter back from sorted order to vocabulary order; with p = 1, return
    early: tail probabilities can underflow to 0 so that a running sum reaches
    1.0 before the end of the list and drops them. With ties at the boundary,
    keep only as many as the mass needs (which of the tied tokens survive is up
    to your sort).
    """
    raise NotImplementedError("ch01: implement top_p_filter")
