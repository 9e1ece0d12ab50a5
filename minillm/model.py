"""A Llama-style decoder in pure PyTorch, small enough to read in one sitting.

Covers the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral without sliding
window) and Qwen2 (bias on the q/k/v projections). Module and parameter names
match Hugging Face's, so an HF checkpoint loads with a plain `load_state_dict`.

The forward pass takes token ids *and* their positions: chapter 02 adds a KV
cache by passing positions that continue where the prompt stopped.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from minillm.kv_cache import KVCache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# config.json keys that from_hf turns into fields (the rest is carried through unread).
_HF_KEYS_READ = (
    "architectures",
    "model_type",
    "hidden_act",
    "rope_parameters",
    "attention_bias",
    "dtype",
)


@dataclass
class ModelConfig:
    """Hyper-parameters, named as in Hugging Face's `config.json`."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # keys we carry unread

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read an HF `config.json` dict (transformers 4.x and 5.x layouts)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: minillm implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-style decoders)"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: only 'silu'")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window is not None and window < cfg.get("max_position_embeddings", 0):
            raise ValueError(
                f"sliding_window={window} is not implemented: minillm attends to the full "
                "context; use a checkpoint without a sliding window"
            )
        # transformers 5 nests rope settings under rope_parameters; 4.x uses two keys.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}: use default, linear or llama3")
        is_qwen = arch == "Qwen2ForCausalLM"
        bias = cfg.get("attention_bias", False)
        consumed = {*cls.__dataclass_fields__, *_HF_KEYS_READ}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=is_qwen or bias,
            o_bias=bias and not is_qwen,
            mlp_bias=cfg.get("mlp_bias", False),
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            extra={k: v for k, v in cfg.items() if k not in consumed},
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict that transformers (4.x and 5.x) and minillm both read."""
        d = asdict(self)
        extra, arch = d.pop("extra"), d.pop("architecture")
        qkv_bias, o_bias = d.pop("qkv_bias"), d.pop("o_bias")
        is_qwen = arch == "Qwen2ForCausalLM"
        if (is_qwen and o_bias) or (not is_qwen and qkv_bias != o_bias):
            raise ValueError(f"{arch} cannot express qkv_bias={qkv_bias}, o_bias={o_bias}")
        if not is_qwen:
            d["attention_bias"] = qkv_bias
        if d["rope_scaling"] is None:
            del d["rope_scaling"]
        model_type = {"Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
        return {
            **extra,
            **d,
            "architectures": [arch],
            "model_type": model_type.get(arch, "llama"),
            "hidden_act": "silu",
        }


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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

    def forward(self, x, positions, cos, sin, mask, cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if getattr(cache, "use_kernel", False):  # chapter 07: the paged cache's own kernel
            out = cache.attention(self.layer_idx, q, k, v, positions)
        else:
            if cache is not None:  # store this step's K/V, attend over everything stored so far
                k, v = cache.update(self.layer_idx, k, v, positions)
            # Grouped-query attention: each kv head serves n_heads / n_kv_heads query heads.
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`positions` defaults to 0..T-1. Without a cache, attention is causal over the T
        tokens given; with one, the tokens' K/V are written at their positions and each
        token attends to every cached position up to its own. `mask` (bool [B, 1, T, S],
        True = attend) overrides either."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = positions.expand(input_ids.shape[0], -1)
        if cache is not None and mask is None:
            mask = cache.causal_mask(positions)
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, cos, sin, mask, cache)
        return self.lm_head(self.model.norm(x))

    def num_parameters(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())
