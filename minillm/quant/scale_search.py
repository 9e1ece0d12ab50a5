"""Choosing a scale group's input scales by the error they leave at the output of the
module the group feeds: the search AWQ and SmoothQuant's per-layer alpha share.

Both methods fold per-channel scales s into the op before a group of linears
(`smoothing.fold_scales`) and pick s from a one-parameter family s(alpha), alpha on a
grid. What "best" means is the question. Scoring each linear's own output is cheap but
blind to what happens next: q and k matter only through the softmax, gate only through
the SiLU, and the three of q, k, v share one s. The AWQ paper's code scores the output of
the module the group feeds instead, with only the group's weights quantized:

    input_layernorm -> q, k, v                the attention output (o_proj left in float)
    self_attn.v_proj -> o_proj                o_proj's output
    post_attention_layernorm -> gate, up      the MLP output (down_proj left in float)
    mlp.up_proj -> down_proj                  down_proj's output

`ModuleProbe` replays that module on the calibration inputs it received and keeps its
float output; `search_scales` tries each candidate s with the group's weights (and, for
W8A8, its input) quantized, and returns the candidate with the smallest relative output
error. Nothing is folded here: the caller folds the winner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from minillm.model.transformer import Block
from minillm.quant.sequential import Calibration, capture_batches
from minillm.quant.smoothing import ScaleGroup

# scale group's input op -> the module whose output scores its scales (names in a block)
INSPECT = {
    "input_layernorm": "self_attn",
    "self_attn.v_proj": "self_attn.o_proj",
    "post_attention_layernorm": "mlp",
    "mlp.up_proj": "mlp.down_proj",
}

Quantizer = Callable[[torch.Tensor], torch.Tensor]  # a tensor -> its rounded values


class ModuleProbe:
    """The module a scale group feeds, the calibration inputs it receives (whole
    sequences, at most `max_tokens` of them) and its float output on them.

    The module's input is the group's input in all four cases, so `absmax` and `mean_abs`
    (per input channel, over every calibration token) are the statistics the scale
    formulas read."""

    def __init__(
        self, block: Block, group: ScaleGroup, calib: Calibration, max_tokens: int = 4096
    ) -> None:
        if group.prev not in INSPECT:
            raise ValueError(f"no module to score scales folded into {group.prev!r}")
        self.block, self.name = block, INSPECT[group.prev]
        self.module = block.get_submodule(self.name)
        xs = capture_batches(block, calib, [self.name])[self.name]
        rows = torch.cat([x.flatten(0, -2) for x in xs])
        self.absmax, self.mean_abs = rows.abs().amax(0), rows.abs().mean(0)
        self.inputs: list[torch.Tensor] = []
        self.rope: list[tuple[torch.Tensor, ...]] = []
        for x, rope in zip(xs, calib.rope, strict=True):  # whole sequences: attention needs them
            room = (max_tokens - sum(t.shape[0] * t.shape[1] for t in self.inputs)) // x.shape[1]
            if room <= 0:
                break
            self.inputs.append(x[:room])
            self.rope.append(tuple(t[:room] for t in rope))
        self.reference = self.run()

    @torch.inference_mode()
    def run(self) -> list[torch.Tensor]:
        """The module's output on each kept input batch, with its current weights."""
        if self.name == "self_attn":
            return [
                self.module(x, positions, cos, sin, None, None)
                for x, (positions, cos, sin) in zip(self.inputs, self.rope, strict=True)
            ]
        return [self.module(x) for x in self.inputs]

    def error(self) -> float:
        """||out - reference||^2 / ||reference||^2 over every kept token."""
        outs = self.run()
        num = sum((o - r).pow(2).sum() for o, r in zip(outs, self.reference, strict=True))
        den = sum(r.pow(2).sum() for r in self.reference)
        return float(num / den)


@contextlib.contextmanager
def _quantized_inputs(
    linears: Sequence[nn.Module], s: torch.Tensor, act_q: Quantizer | None
) -> Iterator[None]:
    """While open, each linear reads act_q(x / s) * s: with its weight set to
    Q(W diag(s)) / s it then computes Q(W diag(s)) act_q(x / s), the folded layer."""
    if act_q is None:
        yield
        return
    hooks = [lin.register_forward_pre_hook(lambda m, a: (act_q(a[0] / s) * s,)) for lin in linears]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@torch.inference_mode()
def search_scales(
    probe: ModuleProbe,
    group: ScaleGroup,
    candidates: dict[float, torch.Tensor],
    weight_q: Quantizer,
    act_q: Quantizer | None = None,
) -> tuple[float, dict[float, float]]:
    """(the best key, {key: relative output error}) over `candidates` {alpha: s}: each s
    is tried as if folded, with the group's weights rounded by `weight_q` (and their
    input by `act_q`), scored on the probe's module output. The weights are restored."""
    linears = [probe.block.get_submodule(name) for name in group.linears]
    originals = [lin.weight.detach().clone() for lin in linears]
    errors: dict[float, float] = {}
    try:
        for key, s in candidates.items():
            for lin, w in zip(linears, originals, strict=True):
                lin.weight.copy_((weight_q(w.float() * s) / s).to(w.dtype))
            with _quantized_inputs(linears, s, act_q):
                errors[key] = probe.error()
    finally:
        for lin, w in zip(linears, originals, strict=True):
            lin.weight.copy_(w)
    return min(errors, key=errors.__getitem__), errors
