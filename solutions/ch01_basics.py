"""Chapter 01 reference answers: same functions and docstrings' contract as
`exercises/ch01_basics.py`, written in plain torch (read the docstrings there).

The tests compare these with `minillm.model`, `minillm.generation.sampling`, transformers
and torch's SDPA, so nothing here imports minillm.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """weight * x / sqrt(mean(x**2) + eps) over the last dim, computed in fp32."""
    xf = x.float()  # fp16 would overflow in x**2 for |x| > 256
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * (xf * inv_rms).to(x.dtype)  # Llama's order: cast back, then gain


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """inv_freq[i] = theta ** (-2i / head_dim), float32 [head_dim // 2]."""
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even: RoPE rotates channel pairs")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / theta**exponents


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of x [B, H, T, d] by positions [T] or [B, T] x inv_freq."""
    inv_freq = rope_frequencies(x.shape[-1], theta).to(x.device)
    if positions.dim() == 1:
        positions = positions[None]  # [1, T]: the same positions for every sequence
    angles = positions.to(x.device).float()[..., None] * inv_freq  # [B, T, d/2], fp32
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, d]: broadcast over heads
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # the partner of channel i, with the sign of sin
    return (xf * angles.cos() + rotated * angles.sin()).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, n_kv, T, d] -> [B, n_kv * n_rep, T, d], kv head h // n_rep for query head h."""
    if n_rep < 1:
        raise ValueError(f"n_rep={n_rep} must be >= 1")
    if n_rep == 1:
        return x
    b, n_kv, t, d = x.shape
    # A new axis right after the kv heads, expanded (a view, no copy), then merged:
    # heads come out as 0, 0, 1, 1 (not 0, 1, 0, 1 as x.repeat would give).
    return x[:, :, None].expand(b, n_kv, n_rep, t, d).reshape(b, n_kv * n_rep, t, d)


def gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Causal attention of q [B, H, T, d] over k, v [B, KV, T, d], RoPE applied, GQA."""
    n_rep = q.shape[1] // k.shape[1]  # query heads per kv head

    def rope(x: torch.Tensor) -> torch.Tensor:  # rotate pairs (i, i + d/2), in fp32
        x1, x2 = x.float().chunk(2, dim=-1)
        return x.float() * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]

    qf, kf = rope(q), rope(k)
    b, n_kv, t, d = kf.shape
    kf = kf[:, :, None].expand(b, n_kv, n_rep, t, d).reshape(b, n_kv * n_rep, t, d)  # 0,0,1,1
    vf = v.float()[:, :, None].expand(b, n_kv, n_rep, t, d).reshape(b, n_kv * n_rep, t, d)
    scores = qf @ kf.transpose(-2, -1) / d**0.5  # [B, H, T, T], fp32: no fp16 overflow
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)  # key after query
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (weights @ vf).to(q.dtype)


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [q_len, kv_len], True where key j <= query i's absolute position."""
    if not 1 <= q_len <= kv_len:
        raise ValueError(f"need 1 <= q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)  # queries are the last q_len
    k_pos = torch.arange(kv_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Set to -inf every token outside the smallest top set whose probability is >= p."""
    if not 0 < p <= 1:
        raise ValueError(f"p={p} must be in (0, 1]")
    if p == 1:
        return logits.clone()
    probs = logits.float().softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked higher
    drop_sorted = mass_above >= p  # the first token to reach p has mass_above < p: kept
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # vocabulary order
    return logits.masked_fill(drop, float("-inf"))
