"""The decode layout changes where the weights sit in memory, nothing a reader can see:
same logits (to rounding), same greedy tokens, same state dict, same saved checkpoint."""

import copy

import pytest
import torch

from minillm import SamplingParams, generate, load_model, save_model
from minillm.model.layout import decode_layout, is_decode_layout, side_by_side


def _groups(model):
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        yield a.qkv, (a.q_proj, a.k_proj, a.v_proj)
        yield m.gate_up, (m.gate_proj, m.up_proj)


def test_decode_layout_keeps_values_ties_tokens_and_checkpoints(model, prompts, tmp_path):
    fast = decode_layout(load_model())
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_decode_layout(m.weight) for m in linears)
    assert fast.lm_head.weight is fast.model.embed_tokens.weight  # still tied
    with torch.inference_mode():
        assert all(group.serves(*layers) for group, layers in _groups(fast))
    groups = [group for group, _ in _groups(fast)]
    assert decode_layout(fast) is fast  # idempotent: nothing re-laid twice
    assert [group for group, _ in _groups(fast)] == groups
    for name, w in model.state_dict().items():
        assert torch.equal(w, fast.state_dict()[name]), name
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with torch.inference_mode():
        ids = torch.tensor([prompts[1]])
        # To rounding: BLAS sums the transposed weight in another order, a few fp32 ulps of
        # logits near 20 (1.1e-5 on an AMX Xeon); a misplaced weight moves them by whole units.
        torch.testing.assert_close(fast(ids), model(ids), atol=1e-5, rtol=2e-6)
    assert generate(fast, prompts, params) == generate(model, prompts, params)
    reloaded = load_model(save_model(fast, tmp_path / "saved"))
    assert all(w.is_contiguous() for w in reloaded.state_dict().values())
    assert generate(reloaded, prompts, params) == generate(model, prompts, params)


def test_side_by_side_steps_aside_when_the_layers_change(model, prompts):
    """A layer replaced, a weight re-assigned, a gradient wanted or a deep copy: the layers'
    own path, with the layers' own (new) weights; `decode_layout` again restores the group."""
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        want = model(ids)
    fast = decode_layout(copy.deepcopy(model))
    attn = fast.model.layers[0].self_attn
    with torch.inference_mode():
        assert attn.qkv.serves(attn.q_proj, attn.k_proj, attn.v_proj)
    fast.train()
    loss = fast(ids).logsumexp(-1).mean()
    loss.backward()  # grad mode: each layer's own weight, so each gets its gradient
    assert all(m.weight.grad is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    fast.eval()
    copied = copy.deepcopy(fast)
    c_attn = copied.model.layers[0].self_attn
    with torch.inference_mode():
        assert not c_attn.qkv.serves(c_attn.q_proj, c_attn.k_proj, c_attn.v_proj)
        torch.testing.assert_close(copied(ids), want, atol=1e-5, rtol=2e-6)
        decode_layout(copied)
        assert c_attn.qkv.serves(c_attn.q_proj, c_attn.k_proj, c_attn.v_proj)
    doubled = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    with torch.no_grad():
        doubled.weight.copy_(2 * attn.q_proj.weight)
    attn.q_proj = doubled  # a quantizer's kind of change: the group no longer holds q
    with torch.inference_mode():
        assert not attn.qkv.serves(attn.q_proj, attn.k_proj, attn.v_proj)
        q, _, _ = attn.project(torch.ones(1, 1, doubled.in_features))
        torch.testing.assert_close(q, doubled(torch.ones(1, 1, doubled.in_features)))
    half = copy.deepcopy(model)
    decode_layout(half).half()
    h_attn = half.model.layers[0].self_attn
    with torch.inference_mode():
        assert not h_attn.qkv.serves(h_attn.q_proj, h_attn.k_proj, h_attn.v_proj)
        assert half(ids).dtype == torch.float16


def test_side_by_side_with_biases_and_its_refusal():
    layers = [torch.nn.Linear(8, n) for n in (4, 2, 2)]
    x = torch.randn(3, 5, 8)
    want = [m(x) for m in layers]
    group = side_by_side(*layers)
    with torch.inference_mode():
        assert group.serves(*layers)
        for got, w in zip(group(x), want, strict=True):
            torch.testing.assert_close(got, w)
    with pytest.raises(ValueError, match="all of the layers with a bias, or none"):
        side_by_side(torch.nn.Linear(8, 4), torch.nn.Linear(8, 4, bias=False))
