"""A Llama-style decoder in pure PyTorch, small enough to read in one sitting.

Covers the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral without sliding
window) and Qwen2 (bias on the q/k/v projections). Module and parameter names
match Hugging Face's, so an HF checkpoint loads with a plain `load_state_dict`.

The forward pass takes token ids *and* their positions: chapter 02 adds a KV
cache by passing positions that continue where the prompt stopped.

The norm, RoPE and no-cache attention are plain functions (`rms_norm`, `apply_rope`,
`causal_attention`) that the layers take from `Transformer.ops`: an exporter, a kernel or a
quantizer gives one model its own form of one of them with `model.using(...)` (`Ops`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from minillm.cache.protocol import Cache
from minillm.model.config import ModelConfig

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps)
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, cos, sin)
AttentionFn = Callable[  # (q, k, v, mask): mask None = causal
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, computed in fp32 as Llama does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """The norm's weight and eps; `norm` is the math that uses them (`Ops.norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, norm: NormFn = rms_norm) -> torch.Tensor:
        return norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotation frequency of each channel pair, with linear or Llama-3 scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2).float() / dim)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        # Long wavelengths (> original context / low_freq_factor) are slowed down by
        # `factor`, short ones (< original / high_freq_factor) kept, the band between
        # interpolated smoothly.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos and sin tables [B, T, head_dim] for integer positions [B, T]."""
    angles = positions[..., None].float() * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of x [B, H, T, d] by the position angle."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of q [B, heads, T, d] over the same T tokens' k, v [B, kv_heads, T, d], no
    cache: causal, or following `mask` (bool [B, 1, T, T], True = attend). Grouped-query:
    each kv head serves heads / kv_heads query heads."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )


@dataclasses.dataclass(frozen=True)
class Ops:
    """The model's extension point: the three ops whose form the rest of the stack may want
    to choose. An exporter writes a norm as one ONNX node or leaves RoPE to the attention
    node, a kernel brings its own attention, a quantizer its own norm: each gives the model
    its form with `model.using(norm=..., rope=..., attention=...)`, for that model only and
    only inside the `with`, where patching this module or torch would change every model in
    the process. The attention over a KV cache is not here: that is the cache's
    (`Cache.attention`; `SdpaCache.sdpa`)."""

    norm: NormFn = rms_norm  # (x, weight, eps) -> x normalised
    rope: RopeFn = apply_rope  # (x [B, H, T, d], cos, sin) -> x rotated
    attention: AttentionFn = causal_attention  # no cache: (q, k, v, mask or None = causal)


DEFAULT_OPS = Ops()


@dataclasses.dataclass(eq=False)
class SideBySide:
    """Linear layers that read the same input, their weights stored as the column blocks
    of one [in, sum of outs] buffer (`minillm.model.layout.decode_layout` builds it): one
    matrix-vector product serves them all, then a split. Each layer's weight stays its
    own `Parameter`, a transposed view of its block, so the state dict, a checkpoint and
    any reader see the separate layers unchanged.

    It serves only while it still holds what the layers hold (`serves`): a layer replaced
    (a quantizer's), a weight re-assigned (`.half()`, `.to()`), a backward pass needed
    (the buffer is not a parameter: no gradient would reach the layers), a compile (which
    sees the layers, not pointers) or a deep copy (PyTorch clones each parameter on its own:
    lay the copy out again) takes the layers' own path."""

    weight: torch.Tensor  # [in, sum of outs]
    bias: torch.Tensor | None  # [sum of outs], when the layers have biases
    linears: tuple[nn.Linear, ...]
    sizes: tuple[int, ...]

    def serves(self, *linears: nn.Module) -> bool:
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or linears != self.linears:
            return False
        base, size = self.weight.data_ptr(), self.weight.element_size()
        offsets = itertools.accumulate(self.sizes, initial=0)  # each block's first column
        return all(
            m.weight.data_ptr() == base + o * size for m, o in zip(linears, offsets, strict=False)
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # weight.t() is [sum of outs, in]: F.linear hands the [in, out] buffer to BLAS as is
        return F.linear(x, self.weight.t(), self.bias).split(self.sizes, dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which layer's slots of a KV cache this attention owns
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        hd = self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv: SideBySide | None = None  # the decode layout's one buffer for q, k, v

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, T, heads * head_dim] of x: three GEMMs, or one where the decode
        layout put the three weights side by side; chapter 04's fused attention overrides
        this with its own."""
        if self.qkv is not None and self.qkv.serves(self.q_proj, self.k_proj, self.v_proj):
            q, k, v = self.qkv(x)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Cache | None,
        ops: Ops = DEFAULT_OPS,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
        if cache is not None:  # the cache stores k, v and attends over all it holds
            out = cache.attention(self.layer_idx, q, k, v, positions)
        else:
            out = ops.attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up: SideBySide | None = None  # the decode layout's one buffer for both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_up.serves(self.gate_proj, self.up_proj):
            gate, up = self.gate_up(x)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, cos, sin, mask, cache, ops: Ops = DEFAULT_OPS):
        # ops: the model's (`Transformer.ops`); the default lets a quantizer run one block alone
        h = normed(self.input_layernorm, x, ops)
        x = x + self.self_attn(h, positions, cos, sin, mask, cache, ops)
        return x + self.mlp(normed(self.post_attention_layernorm, x, ops))


def normed(norm: nn.Module, x: torch.Tensor, ops: Ops) -> torch.Tensor:
    """`norm(x)` in the form `ops.norm` gives; a norm module of another kind (chapter 04's
    weight-folded `ScaleFreeRMSNorm`) computes its own."""
    return norm(x, ops.norm) if isinstance(norm, RMSNorm) else norm(x)


class Decoder(nn.Module):
    """Embedding, blocks, final norm: HF's `model.*` sub-tree."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Token ids [B, T] and positions [B, T] in, next-token logits [B, T, vocab] out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.ops = Ops()

    @contextlib.contextmanager
    def using(self, **changes: Callable[..., torch.Tensor]) -> Iterator[Transformer]:
        """`with model.using(rope=...):` this model runs with those of its `ops` replaced
        (fields of `Ops`: norm, rope, attention), and its own again on the way out, after
        an error too. Nothing global changes: every other model keeps its ops (this one's
        are swapped for whatever runs it inside the `with`)."""
        before = self.ops
        self.ops = dataclasses.replace(before, **changes)
        try:
            yield self
        finally:
            self.ops = before

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions` defaults to 0..T-1. Without a cache, attention is causal over the T
        tokens given, or follows `mask` (bool [B, 1, T, T], True = attend). With a cache, the
        tokens' K/V go into it at their positions and each token attends to every cached
        position up to its own: the cache decides what each query sees. `logits_at`: only
        these indices along T get logits ([B, len(logits_at), vocab]); an engine step needs
        one row per sampled sequence, not a vocabulary-wide row for every prompt token."""
        if cache is not None and mask is not None:
            raise ValueError(
                "a cache decides which slots each query sees: give mask= only without one"
            )
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = positions.expand(input_ids.shape[0], -1)
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, cos, sin, mask, cache, self.ops)
        return self.head(x, logits_at)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The forward's first step: token ids [B, T] to hidden states [B, T, hidden] (a
        pipeline stage after the first takes hidden states and passes them on)."""
        return self.model.embed_tokens(input_ids)

    def head(self, x: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor:
        """The forward's last step: the final norm and the LM head, at `logits_at` only (a
        pipeline stage before the last returns its hidden states instead)."""
        if logits_at is not None:
            x = x[:, logits_at]
        return self.lm_head(normed(self.model.norm, x, self.ops))

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> Transformer:
        """`.half()`, `.to(torch.bfloat16)` and friends cast every buffer; the rotation
        frequencies must stay fp32 (in fp16, position 8000's angle is off by radians), so
        they are rebuilt in fp32 on whatever device the weights went to."""
        super()._apply(fn, recurse)
        if self.lm_head.weight.device.type != "meta":
            self.inv_freq = rope_inv_freq(self.config).to(self.lm_head.weight.device)
        return self

    def num_parameters(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())
