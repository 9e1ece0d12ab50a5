"""The C RMSNorm and rotary embedding (`minillm.kernels.rowops`) against the model's PyTorch
ops: the same numbers to float rounding, on the strided q and k a layer hands them, every
input they do not take handed to the PyTorch op unchanged, and the same greedy tokens
through a whole model."""

import copy

import pytest
import torch

from minillm import SamplingParams, generate
from minillm.cache import KVCache
from minillm.cache.paged import PagedKVCache, attend
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


def filled(cfg, decode_kernel: bool) -> KVCache:
    cache = KVCache(cfg, 3, 16)
    g = torch.Generator().manual_seed(0)
    for buffer in (cache.k, cache.v):
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    cache.decode_kernel, cache.kv_len = decode_kernel, 12
    return cache


def test_decode_attention_matches_the_pytorch_path(model):
    """Rows at different positions, one past the kv_len window, grouped-query heads: the C
    step writes the same K/V and returns the same attention as the mask-and-SDPA path."""
    cfg = model.config
    fast, slow = filled(cfg, True), filled(cfg, False)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, cfg.num_attention_heads, 1, cfg.head_dim, generator=g)
    k, v = (torch.randn(3, cfg.num_key_value_heads, 1, cfg.head_dim, generator=g) for _ in "kv")
    positions = torch.tensor([[11], [4], [13]])  # 13: past kv_len, sees the 12 slots
    assert rowops.decode_attention(fast.k[1], fast.v[1], q, k, v, positions, 12) is not None
    fast = filled(cfg, True)  # the direct call above wrote into it: start again
    torch.testing.assert_close(
        fast.attention(1, q, k, v, positions), slow.attention(1, q, k, v, positions)
    )
    assert torch.equal(fast.k, slow.k) and torch.equal(fast.v, slow.v)


def test_decode_attention_leaves_other_steps_to_pytorch(model):
    cfg = model.config
    cache = filled(cfg, True)
    q = torch.randn(1, cfg.num_attention_heads, 2, cfg.head_dim)  # two tokens: a prompt chunk
    k = v = torch.randn(1, cfg.num_key_value_heads, 2, cfg.head_dim)
    assert (
        rowops.decode_attention(cache.k[0], cache.v[0], q, k, v, torch.tensor([[3, 4]]), 12) is None
    )
    q1, k1 = q[:, :, :1].half(), k[:, :, :1].half()
    pos = torch.tensor([[3]])
    assert rowops.decode_attention(cache.k[0], cache.v[0], q1, k1, k1, pos, 12) is None
    with pytest.raises(IndexError, match="16 slots"):
        rowops.decode_attention(
            cache.k[0], cache.v[0], q1.float(), k1.float(), k1.float(), torch.tensor([[16]]), 12
        )


def test_paged_attention_matches_the_gather_path(model):
    """Decode rows of different lengths through block tables (one padded with -1): the C
    kernel reads the pool in place and returns what gathering the blocks for SDPA does."""
    cfg = model.config
    cache = PagedKVCache(cfg, num_blocks=8, block_size=4)
    g = torch.Generator().manual_seed(2)
    for pool in (cache.k, cache.v):
        pool.copy_(torch.randn(pool.shape, generator=g))
    tables, lens = torch.tensor([[3, 1, 6], [2, 5, -1]]), torch.tensor([10, 6])
    q = torch.randn(2, cfg.num_attention_heads, cfg.head_dim, generator=g)
    fast = rowops.paged_attention(q, cache.k[0], cache.v[0], tables, lens)
    k_rows, v_rows = cache.gather(0, tables, q.dtype)
    torch.testing.assert_close(fast, attend(q[:, :, None], k_rows, v_rows, lens)[:, :, 0])
    with pytest.raises(IndexError, match="do not hold"):
        rowops.paged_attention(q, cache.k[0], cache.v[0], tables, torch.tensor([10, 9]))
    assert rowops.paged_attention(q.half(), cache.k[0], cache.v[0], tables, lens) is None


def test_a_cache_with_its_own_update_keeps_it(model):
    """A subclass's `update` (chapter 02's exercise grades one) runs on every step: the C
    step would write the K/V itself, so it is not taken."""
    calls = []

    class Counting(KVCache):
        def update(self, layer, k, v, positions):
            calls.append(layer)
            return super().update(layer, k, v, positions)

    cfg = model.config
    cache = Counting(cfg, 1, 8)
    cache.kv_len = 4
    q = torch.randn(1, cfg.num_attention_heads, 1, cfg.head_dim)
    k = v = torch.randn(1, cfg.num_key_value_heads, 1, cfg.head_dim)
    cache.attention(0, q, k, v, torch.tensor([[3]]))
    assert calls == [0]
