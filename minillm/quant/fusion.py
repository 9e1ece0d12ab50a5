"""Layer fusion on our own model: what TensorRT's graph optimizer does, done by hand.

Three rewrites, each exact in real arithmetic (fp32 rounding aside):

    fold norms    RMSNorm computes g * x_hat; the linear after it computes W (g * x_hat)
                  = (W diag(g)) x_hat, so scale W's columns by g once and drop the multiply.
    fuse QKV      q, k and v projections read the same input: one [q; k; v] weight, one
                  GEMM, then a split (three matmul launches become one, wider one).
    fuse gate/up  the same for the MLP's gate and up projections.

`fuse_model` returns a fused copy (the original is untouched); `minillm.lab.count_ops`
counts the aten ops a forward dispatches (on a GPU, one compute op is one kernel launch),
which is what fusion saves. The fused modules keep the model's call signatures, so the KV cache and
`generate` work unchanged.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.transformer import MLP, Attention, RMSNorm, Transformer


class ScaleFreeRMSNorm(nn.Module):
    """x / rms(x): an RMSNorm whose weight was folded into the linear(s) that follow."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    # On the weight's device and dtype: a model on a GPU stays there once fused.
    out = nn.Linear(
        weight.shape[1],
        weight.shape[0],
        bias=bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out.requires_grad_(False)


def _cat_linears(*linears: nn.Linear) -> nn.Linear:
    """One linear computing [a(x); b(x); ...]: weights (and biases) stacked by rows."""
    weight = torch.cat([m.weight for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot fuse linears where only some have a bias")
    bias = torch.cat([m.bias for m in linears]) if all(has_bias) else None
    return _linear(weight, bias)


class FusedAttention(Attention):
    """`Attention` with q/k/v as one GEMM: only the projection hook differs, so the
    attention itself (RoPE, the cache protocol, GQA) is the model's own code."""

    def __init__(self, attn: Attention) -> None:
        nn.Module.__init__(self)  # not Attention's: its q/k/v layers are replaced, not built
        self.layer_idx = attn.layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.qkv_proj = _cat_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        hd = self.head_dim
        self.sizes = [self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        return q, k, v


class FusedMLP(nn.Module):
    """SwiGLU with gate and up as one GEMM: down(silu(g) * u), [g; u] = gate_up(x)."""

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        self.gate_up_proj = _cat_linears(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _fold(norm: RMSNorm, *linears: nn.Linear) -> ScaleFreeRMSNorm:
    """Scale each linear's input columns by the norm's weight; return the weightless norm."""
    with torch.no_grad():
        for m in linears:
            m.weight.mul_(norm.weight.to(m.weight.dtype))
    return ScaleFreeRMSNorm(norm.eps)


def fuse_model(
    model: Transformer,
    fold_norms: bool = True,
    fuse_qkv: bool = True,
    fuse_gate_up: bool = True,
) -> Transformer:
    """A fused copy of `model` (same logits up to fp32 rounding); the original is untouched.

    Folding the final norm unties `lm_head` from the embedding (it becomes E diag(g)): one
    more vocab x hidden matrix in memory, the price of one fewer multiply per token.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"fuse_model expects a minillm Transformer, got {type(model).__name__}")
    fused = copy.deepcopy(model).eval()
    for layer in fused.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
            raise ValueError("the model is already fused: call fuse_model on the original")
        if fold_norms:
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            layer.input_layernorm = _fold(layer.input_layernorm, *qkv)
            layer.post_attention_layernorm = _fold(
                layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj
            )
        if fuse_qkv:
            layer.self_attn = FusedAttention(attn)
        if fuse_gate_up:
            layer.mlp = FusedMLP(mlp)
    if fold_norms:
        head = fused.lm_head
        fused.lm_head = _linear(head.weight.detach().clone(), head.bias)  # untie
        fused.model.norm = _fold(fused.model.norm, fused.lm_head)
    return fused
