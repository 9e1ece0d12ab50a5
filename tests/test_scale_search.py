"""The module-level scale search AWQ and SmoothQuant share (minillm.quant.scale_search)."""

from __future__ import annotations

import copy

import pytest
import torch

from minillm.quant import quantize_int4
from minillm.quant.formats import absmax_quantize, dequantize
from minillm.quant.linear import fake_quant_activations
from minillm.quant.scale_search import INSPECT, ModuleProbe, search_scales
from minillm.quant.sequential import calibration_states
from minillm.quant.smoothing import ScaleGroup, fold_scales, scale_groups


def _calib(model):
    g = torch.Generator().manual_seed(0)
    return calibration_states(
        model, [torch.randint(1, model.config.vocab_size, (2, 40), generator=g)]
    )


def _int4(w: torch.Tensor) -> torch.Tensor:
    return quantize_int4(w, 32).dequantize()


def _int8(w: torch.Tensor) -> torch.Tensor:
    return dequantize(*absmax_quantize(w, 8, per_channel=True))


@pytest.mark.parametrize("which", range(3))  # bundled (GQA): qkv, gate/up, down groups
def test_probe_replays_the_module_the_group_feeds(model, which: int) -> None:
    block = model.model.layers[1]
    group = scale_groups(block)[which]
    calib = _calib(model)
    probe = ModuleProbe(block, group, calib, max_tokens=10_000)
    assert probe.name == INSPECT[group.prev]
    seen = []
    hook = block.get_submodule(probe.name).register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.inference_mode():
            x, (pos, cos, sin) = calib.hidden[0], calib.rope[0]
            block(x, pos, cos, sin, None, None)
    finally:
        hook.remove()
    assert torch.allclose(probe.reference[0], seen[0], atol=1e-6)
    assert probe.error() == pytest.approx(0.0, abs=1e-12)  # float weights: no error yet


def test_probe_keeps_whole_sequences_up_to_max_tokens(model) -> None:
    block = model.model.layers[0]
    probe = ModuleProbe(block, scale_groups(block)[0], _calib(model), max_tokens=40)
    assert [tuple(x.shape[:2]) for x in probe.inputs] == [(1, 40)]
    assert probe.rope[0][1].shape[:2] == (1, 40)  # cos follows the kept rows
    with pytest.raises(ValueError, match="no module"):
        ModuleProbe(block, ScaleGroup("mlp.gate_proj", ("mlp.down_proj",)), _calib(model))


@pytest.mark.parametrize("w8a8", [False, True])
def test_search_scores_each_candidate_as_if_folded(model, w8a8: bool) -> None:
    """The error `search_scales` reports for s equals the error of a block copy with s
    really folded in and the group's weights (and inputs) really rounded; the block's
    weights are left as they were."""
    block = model.model.layers[0]
    group = scale_groups(block)[1]  # post_attention_layernorm -> gate, up: scored on the MLP
    calib = _calib(model)
    probe = ModuleProbe(block, group, calib)
    s = torch.linspace(0.5, 2.0, model.config.hidden_size)
    act = (lambda x: fake_quant_activations(x, "token")) if w8a8 else None
    weight_q = _int8 if w8a8 else _int4
    before = {k: v.clone() for k, v in block.state_dict().items()}
    best, errors = search_scales(probe, group, {1.0: s, 0.0: torch.ones_like(s)}, weight_q, act)
    assert all(torch.equal(v, before[k]) for k, v in block.state_dict().items())
    assert best == min(errors, key=errors.__getitem__)

    folded = copy.deepcopy(block)
    fold_scales(folded, group, s)
    with torch.no_grad():
        for name in group.linears:
            lin = folded.get_submodule(name)
            lin.weight.copy_(weight_q(lin.weight))
            if act is not None:
                lin.register_forward_pre_hook(lambda m, a: (act(a[0]),))
    with torch.inference_mode():
        out = [
            folded.mlp(folded.post_attention_layernorm(h + 0)) for h in _mlp_inputs(block, calib)
        ]
    num = sum((o - r).pow(2).sum() for o, r in zip(out, probe.reference, strict=True))
    den = sum(r.pow(2).sum() for r in probe.reference)
    assert errors[1.0] == pytest.approx(float(num / den), rel=1e-4)
    assert errors[1.0] != pytest.approx(errors[0.0], rel=1e-3)  # the scales did matter


def _mlp_inputs(block, calib) -> list[torch.Tensor]:
    """The residual stream entering the block's post-attention norm, per batch."""
    seen = []
    hook = block.post_attention_layernorm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.inference_mode():
            for x, (pos, cos, sin) in zip(calib.hidden, calib.rope, strict=True):
                block(x, pos, cos, sin, None, None)
    finally:
        hook.remove()
    return seen
