"""The C RMSNorm and rotary embedding (`minillm.kernels.rowops`) against the model's PyTorch
ops: the same numbers to float rounding, on the strided q and k a layer hands them, every
input they do not take handed to the PyTorch op unchanged, and the same greedy tokens
through a whole model."""

import copy

import pytest
import torch

from minillm import SamplingParams, generate
from minillm.kernels import matvec, rowops
from minillm.model.layout import use_row_ops
from minillm.model.transformer import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq

ok, why = matvec.matvec_status()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C kernel here: {why}")


def unused(*args):
    raise AssertionError("the C op should have taken this input, not the fallback")


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 128), (7, 64)])
def test_rms_norm_matches_the_model_op(shape):
    g = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(rowops.rms_norm(x, w, 1e-5, unused), rms_norm(x, w, 1e-5))


def test_rope_matches_the_model_op_on_a_layers_strided_q(model):
    cfg = model.config
    b, t, heads, d = 2, 4, cfg.num_attention_heads, cfg.head_dim
    q = torch.randn(b, t, heads * d).view(b, t, heads, d).transpose(1, 2)  # as a layer has it
    assert not q.is_contiguous()
    positions = torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10]])
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), positions)
    torch.testing.assert_close(rowops.rope(q, cos, sin, unused), apply_rope(q, cos, sin))


def test_what_the_c_ops_do_not_take_goes_to_the_model_ops():
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(rowops.rms_norm(x, w, 1e-5, rms_norm), rms_norm(x, w, 1e-5))
    xg = torch.randn(2, 64, requires_grad=True)
    out = rowops.rms_norm(xg, torch.ones(64), 1e-5, rms_norm)
    out.sum().backward()  # the PyTorch op ran: the gradient reaches x
    assert xg.grad is not None
    q, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8)
    strided = torch.randn(1, 3, 16)[..., ::2]  # a cos table that is not contiguous
    assert torch.equal(rowops.rope(q, strided, sin, apply_rope), apply_rope(q, strided, sin))
    qh, sinh = q.half(), sin.half()
    assert torch.equal(rowops.rope(qh, sinh, sinh, apply_rope), apply_rope(qh, sinh, sinh))


def test_a_model_on_the_c_ops_keeps_its_tokens(model, prompts):
    fast = use_row_ops(copy.deepcopy(model))
    assert fast.ops.norm.func is rowops.rms_norm and fast.ops.rope.func is rowops.rope
    assert copy.deepcopy(fast).ops.rope.func is rowops.rope  # a copy keeps them
    with torch.inference_mode():
        ids = torch.tensor([prompts[1]])
        torch.testing.assert_close(fast(ids), model(ids), atol=1e-4, rtol=1e-5)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert generate(fast, prompts[:3], params) == generate(model, prompts[:3], params)
