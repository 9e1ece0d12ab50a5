"""Per-input-channel scales folded into the op before a linear layer: the move AWQ and
SmoothQuant share.

For a linear y = W x, any positive vector s gives the same y as y = (W diag(s)) (x / s).
Dividing x by s costs nothing at run time when the op that produces x absorbs it:

    RMSNorm -> linears        norm.weight /= s, and every linear reading it: W[:, j] *= s_j
    linear A -> linear B      A's output rows: A.weight[j, :] /= s_j (and its bias), B's
                              columns W_B[:, j] *= s_j (SwiGLU: up_proj -> down_proj, since
                              down reads silu(gate) * up, which is linear in up's output)

The model's float outputs are unchanged; only the split of magnitude between activations
and weights moves, which is what each method then exploits for its quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minillm.model.transformer import Block, RMSNorm


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that read the same input, and the op (relative to the block) producing it."""

    prev: str
    linears: tuple[str, ...]


def scale_groups(block: Block) -> list[ScaleGroup]:
    """Where a block can absorb input scales, in forward order (as the AWQ paper does for
    Llama): input norm -> q/k/v; v_proj -> o_proj when their shapes line up (multi-head
    attention; with grouped-query attention o_proj's inputs are the query heads, more than
    v_proj's outputs, so it is skipped); post-attention norm -> gate/up; up -> down."""
    attn, mlp = block.self_attn, block.mlp
    groups = [
        ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
    ]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",)))
    groups.append(ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))
    if mlp.up_proj.out_features == mlp.down_proj.in_features:
        groups.append(ScaleGroup("mlp.up_proj", ("mlp.down_proj",)))
    return groups


@torch.no_grad()
def fold_scales(block: Block, group: ScaleGroup, s: torch.Tensor) -> None:
    """Divide the group's input by `s` [in_features] inside `group.prev` and multiply the
    linears' input columns by it: the block computes the same function afterwards."""
    if (s <= 0).any() or not torch.isfinite(s).all():
        raise ValueError("input scales must be positive and finite: clamp them before folding")
    prev = block.get_submodule(group.prev)
    if isinstance(prev, RMSNorm):
        prev.weight.div_(s.to(prev.weight.dtype))
    elif isinstance(prev, nn.Linear):
        prev.weight.div_(s.to(prev.weight.dtype)[:, None])
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        raise TypeError(f"cannot fold scales into {type(prev).__name__} ({group.prev})")
    for name in group.linears:
        lin = block.get_submodule(name)
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])


def group_weight(block: Block, group: ScaleGroup) -> torch.Tensor:
    """The group's linears stacked along the output axis [sum(out), in]: they share an
    input, so they share its scales."""
    return torch.cat([block.get_submodule(n).weight.detach().float() for n in group.linears])
