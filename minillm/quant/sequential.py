"""Calibration one decoder block at a time: the loop GPTQ and AWQ share.

Both methods need, for each linear layer, the activations that reach its input on real
text. They quantize block by block: block i is calibrated on the hidden states that the
already-processed blocks 0..i-1 produce, so each block sees (and can compensate for)
the error of the ones before it. Running the whole model once per block would redo the
earlier blocks every time; instead `Calibration` keeps the hidden states between
blocks, and `run_block` advances them through one block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from minillm.model.transformer import Block, Transformer, rope_cos_sin


@dataclass
class Calibration:
    """Hidden states entering the next block, one [B, T, hidden] per calibration batch,
    and each batch's positions and rotary tables (the same for every block)."""

    hidden: list[torch.Tensor]
    rope: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # positions, cos, sin

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


@torch.inference_mode()
def calibration_states(model: Transformer, batches: Iterable[torch.Tensor]) -> Calibration:
    """The embeddings of each batch of token ids [B, T]: what block 0 reads."""
    hidden, rope = [], []
    for ids in batches:
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        cos, sin = rope_cos_sin(model.inv_freq, positions)
        hidden.append(model.model.embed_tokens(ids))
        rope.append((positions, cos, sin))
    if not hidden:
        raise ValueError("calibration needs at least one batch of token ids")
    return Calibration(hidden, rope)


@torch.inference_mode()
def run_block(block: Block, calib: Calibration) -> None:
    """Advance the hidden states through `block` (causal attention, no cache), in place."""
    for i, (x, (positions, cos, sin)) in enumerate(zip(calib.hidden, calib.rope, strict=True)):
        calib.hidden[i] = block(x, positions, cos, sin, None, None)


@torch.inference_mode()
def capture_batches(
    block: Block, calib: Calibration, names: Sequence[str]
) -> dict[str, list[torch.Tensor]]:
    """The inputs each named sub-module of `block` (a name relative to the block, e.g.
    'self_attn' or 'mlp.down_proj') receives, one [B, T, in] per calibration batch, in
    fp32: what a module-level search replays (attention needs whole sequences, not rows).
    The hidden states are left as they were."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    hooks = [
        block.get_submodule(name).register_forward_pre_hook(
            lambda mod, args, name=name: seen[name].append(args[0].float())
        )
        for name in names
    ]
    try:
        for x, (positions, cos, sin) in zip(calib.hidden, calib.rope, strict=True):
            block(x, positions, cos, sin, None, None)
    finally:
        for h in hooks:
            h.remove()
    return seen


def capture_inputs(
    block: Block, calib: Calibration, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The input rows [tokens, in_features] that each named sub-module of `block`
    receives over all batches (`capture_batches`, flattened to rows: what a per-linear
    statistic such as GPTQ's Hessian needs)."""
    batches = capture_batches(block, calib, names)
    return {name: torch.cat([x.flatten(0, -2) for x in xs]) for name, xs in batches.items()}


def block_linears(block: nn.Module) -> list[str]:
    """Names (relative to the block) of its nn.Linear layers, in forward order."""
    return [name for name, mod in block.named_modules() if isinstance(mod, nn.Linear)]
