"""Chapter 01 exercises, graded against minillm, transformers and torch.

`ch01` is the module under test: `solutions.ch01_basics` by default,
`exercises.ch01_basics` with MINILLM_IMPL=exercises (see conftest.py). Every
test name starts with `test_ch01_<exercise>` so that `-k ch01` selects the
chapter and `-k "ch01 and top_p"` one exercise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.generation.logits_process import TopPLogitsWarper
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary
from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv

from minillm.generation.sampling import top_k_filter
from minillm.generation.sampling import top_p_filter as minillm_top_p
from minillm.model import ModelConfig, Transformer
from minillm.model.transformer import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- rms_norm -------------------------------------------------------------------------------


def references_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """minillm's RMSNorm and transformers' LlamaRMSNorm with this weight, in weight's dtype."""
    dim = x.shape[-1]
    mini, hf = RMSNorm(dim, eps), LlamaRMSNorm(dim, eps=eps)
    with torch.no_grad():
        for module in (mini, hf):
            module.weight.copy_(weight.float())
            module.to(weight.dtype)
        return mini(x), hf(x)


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 128)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_ch01_rms_norm_matches_minillm_and_transformers(ch01, shape, eps):
    x, weight = randn(*shape, seed=1), randn(shape[-1], seed=2)
    out = ch01.rms_norm(x, weight, eps)
    assert out.shape == x.shape and out.dtype == torch.float32
    for ref in references_rms_norm(x, weight, eps):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)], ids=["fp16", "bf16"]
)
def test_ch01_rms_norm_half_precision_matches_references(ch01, dtype, tol):
    """A half-precision model: x and weight both fp16/bf16, the result in that dtype."""
    x, weight = randn(3, 96, seed=3, scale=4.0).to(dtype), randn(96, seed=4).to(dtype)
    out = ch01.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype, f"rms_norm returned {out.dtype} for {dtype} x and weight"
    for ref in references_rms_norm(x, weight, 1e-5):
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_ch01_rms_norm_fp16_large_activations_need_fp32(ch01):
    """|x| in the thousands is fine in fp16, but x**2 is not (max 65504): square in fp32."""
    x = randn(4, 64, seed=5, scale=1000.0).half()
    assert x.isfinite().all()
    weight = torch.ones(64, dtype=torch.float16)
    out = ch01.rms_norm(x, weight, 1e-6)
    assert out.isfinite().all() and out.abs().max() > 0.5, (
        "rms_norm gave inf/nan/zeros for fp16 inputs around 1000: x**2 overflowed fp16. "
        "Compute the mean of squares in fp32 (x.float()) and cast back at the end."
    )
    expected = (x.double() / x.double().pow(2).mean(-1, keepdim=True).sqrt()).half()
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


def test_ch01_rms_norm_eps_goes_inside_the_square_root(ch01):
    x, weight = torch.full((2, 8), 1e-3), torch.ones(8)
    out = ch01.rms_norm(x, weight, 1e-2)
    expected = torch.full((2, 8), 1e-3 / math.sqrt(1e-6 + 1e-2))  # ~0.01, not 1e-3/(1e-3+1e-2)
    torch.testing.assert_close(
        out, expected, msg="expected x / sqrt(mean(x**2) + eps): eps inside the sqrt"
    )
    zeros = ch01.rms_norm(torch.zeros(3, 8), weight, 1e-6)
    assert torch.equal(zeros, torch.zeros(3, 8)), "an all-zero vector must give zeros, not nan"
    x = randn(5, 16, seed=6, scale=0.1)
    for eps in (0.0, 0.5):  # eps must be the argument, not a constant
        torch.testing.assert_close(ch01.rms_norm(x, torch.ones(16), eps), RMSNorm(16, eps)(x))


def test_ch01_rms_norm_gives_unit_rms_and_per_channel_gain(ch01):
    x, weight = randn(6, 32, seed=7, scale=3.0), randn(32, seed=8)
    unit = ch01.rms_norm(x, torch.ones(32), 0.0)
    rms = unit.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(
        rms, torch.ones(6), msg="each row should have RMS 1 (normalise over the last dim only)"
    )
    torch.testing.assert_close(ch01.rms_norm(7.0 * x, torch.ones(32), 0.0), unit)  # scale-free
    torch.testing.assert_close(ch01.rms_norm(x, weight, 0.0), unit * weight)


# --- rope_frequencies and apply_rotary ------------------------------------------------------


def hf_rope(head_dim: int, theta: float) -> LlamaRotaryEmbedding:
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=theta)
    return LlamaRotaryEmbedding(cfg)


def minillm_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    cfg = ModelConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=4, rope_theta=theta
    )
    return rope_inv_freq(cfg)


@pytest.mark.parametrize("head_dim, theta", [(64, 10000.0), (128, 500000.0), (8, 10.0)])
def test_ch01_rope_frequencies_match_minillm_and_transformers(ch01, head_dim, theta):
    inv_freq = ch01.rope_frequencies(head_dim, theta)
    assert inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, minillm_inv_freq(head_dim, theta))
    torch.testing.assert_close(inv_freq, hf_rope(head_dim, theta).inv_freq)
    assert inv_freq[0] == 1.0 and (inv_freq[1:] < inv_freq[:-1]).all()


def test_ch01_rope_frequencies_reject_odd_head_dim(ch01):
    with pytest.raises(ValueError):
        ch01.rope_frequencies(63, 10000.0)


def minillm_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    inv_freq = minillm_inv_freq(x.shape[-1], theta)
    cos, sin = rope_cos_sin(inv_freq, positions.expand(x.shape[0], -1))
    return apply_rope(x, cos, sin)


POSITIONS = {
    "shared": torch.arange(5),  # [T]: one prompt layout for the whole batch
    "per-sequence": torch.tensor([[0, 1, 2, 3, 4], [40, 41, 42, 43, 44]]),  # [B, T]
}


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("positions", POSITIONS.values(), ids=POSITIONS.keys())
def test_ch01_apply_rotary_matches_minillm_and_transformers(ch01, positions, theta):
    x = randn(2, 3, 5, 16, seed=9)
    out = ch01.apply_rotary(x, positions, theta)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, minillm_rotary(x, positions, theta), rtol=1e-5, atol=1e-5)
    cos, sin = hf_rope(16, theta)(x, positions.expand(2, -1))
    hf_out, _ = hf_apply_rotary(x, x, cos, sin)
    torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float16, 1e-2), (torch.bfloat16, 6e-2)], ids=["fp16", "bf16"]
)
def test_ch01_apply_rotary_half_precision_keeps_angles_in_fp32(ch01, dtype, tol):
    """Positions 3000+ are not exact in fp16/bf16: angles must be computed in fp32."""
    x = randn(1, 2, 8, 32, seed=10).to(dtype)
    positions = torch.arange(3001, 3009)
    out = ch01.apply_rotary(x, positions, 10000.0)
    assert out.dtype == dtype, f"apply_rotary returned {out.dtype} for {dtype} input"
    expected = minillm_rotary(x.float(), positions, 10000.0).to(dtype)
    torch.testing.assert_close(
        out, expected, rtol=tol, atol=tol, msg="far from the fp32 result: angles in half?"
    )


def test_ch01_apply_rotary_position_zero_is_identity(ch01):
    x = randn(2, 2, 4, 8, seed=11)
    torch.testing.assert_close(ch01.apply_rotary(x, torch.zeros(4, dtype=torch.long)), x)


def test_ch01_apply_rotary_preserves_each_pair_norm(ch01):
    """A rotation keeps lengths: pair (i, i + d/2) has the same norm after RoPE."""
    d = 32
    x = randn(2, 2, 6, d, seed=12)
    positions = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(13))
    out = ch01.apply_rotary(x, positions)

    def pair_norms(t: torch.Tensor) -> torch.Tensor:
        return torch.hypot(t[..., : d // 2], t[..., d // 2 :])

    torch.testing.assert_close(
        pair_norms(out),
        pair_norms(x),
        rtol=1e-4,
        atol=1e-5,
        msg="pair norms changed: channel i pairs with i + head_dim/2 (HF's rotate-half layout)",
    )


def test_ch01_apply_rotary_scores_depend_only_on_relative_position(ch01):
    """q at position m, k at position n: q·k is a function of m - n alone."""
    d = 32
    q, k = randn(d, seed=14), randn(d, seed=15)

    def score(m: int, n: int) -> torch.Tensor:
        rq = ch01.apply_rotary(q.view(1, 1, 1, d), torch.tensor([m]))
        rk = ch01.apply_rotary(k.view(1, 1, 1, d), torch.tensor([n]))
        return (rq * rk).sum()

    scale = q.norm() * k.norm()
    for distance in (0, 3, 17):
        scores = torch.stack([score(n + distance, n) for n in (0, 5, 100, 777)])
        assert (scores - scores[0]).abs().max() < 1e-4 * scale, (
            f"q(m)·k(n) changed with m for fixed m - n = {distance}: {scores.tolist()}"
        )
    assert (score(3, 0) - score(0, 0)).abs() > 1e-3 * scale, "RoPE must change the scores"


def test_ch01_apply_rotary_offset_positions_match_the_full_sequence(ch01):
    """What chapter 02's KV cache relies on: tokens 6..9 alone, at positions 6..9,
    rotate exactly as they do inside the whole sequence; and each row of a batch
    uses its own positions."""
    x = randn(2, 2, 10, 16, seed=16)
    full = ch01.apply_rotary(x, torch.arange(10))
    tail = ch01.apply_rotary(x[:, :, 6:], torch.arange(6, 10))
    torch.testing.assert_close(tail, full[:, :, 6:])
    positions = torch.stack([torch.arange(10), torch.arange(10) + 50])
    batched = ch01.apply_rotary(x, positions)
    for b in range(2):
        alone = ch01.apply_rotary(x[b : b + 1], positions[b])
        torch.testing.assert_close(batched[b : b + 1], alone, msg=f"row {b}: use its own positions")


# --- repeat_kv ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_rep", [1, 2, 3])
def test_ch01_repeat_kv_matches_transformers(ch01, n_rep):
    x = randn(2, 2, 5, 8, seed=17)
    out = ch01.repeat_kv(x, n_rep)
    assert out.shape == (2, 2 * n_rep, 5, 8)
    torch.testing.assert_close(out, hf_repeat_kv(x, n_rep), rtol=0, atol=0)


def test_ch01_repeat_kv_keeps_groups_together(ch01):
    x = torch.arange(3.0).view(1, 3, 1, 1).expand(1, 3, 2, 4)  # kv head h is filled with h
    heads = ch01.repeat_kv(x, 2)[0, :, 0, 0].tolist()
    assert heads == [0, 0, 1, 1, 2, 2], (
        f"query heads read kv heads {heads}: expected 0,0,1,1,2,2 (x.repeat tiles 0,1,2,0,1,2)"
    )


def test_ch01_repeat_kv_attention_matches_sdpa_gqa(ch01):
    q = randn(1, 6, 5, 8, seed=18)
    k, v = randn(1, 2, 5, 8, seed=19), randn(1, 2, 5, 8, seed=20)
    out = F.scaled_dot_product_attention(
        q, ch01.repeat_kv(k, 3), ch01.repeat_kv(v, 3), is_causal=True
    )
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)


# --- gqa_attention --------------------------------------------------------------------------


def attention_inputs(b: int, heads: int, kv_heads: int, t: int, d: int, seed: int, theta=1e4):
    """Random q, k, v and the cos/sin tables of positions 0..t-1 (minillm's rope_cos_sin)."""
    q, k, v = (
        randn(b, heads, t, d, seed=seed),
        randn(b, kv_heads, t, d, seed=seed + 1),
        randn(b, kv_heads, t, d, seed=seed + 2),
    )
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = rope_cos_sin(inv_freq, torch.arange(t).expand(b, t))
    return q, k, v, cos, sin


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(4, 2, 32), (9, 3, 64), (4, 4, 16), (4, 1, 8)],
    ids=["bundled", "smollm2", "mha", "mqa"],
)  # fmt: skip
def test_ch01_gqa_attention_matches_the_models_attention(ch01, heads, kv_heads, head_dim):
    """minillm's Attention layer with its own weights: project, your attention, o_proj."""
    torch.manual_seed(40)
    cfg = ModelConfig(
        vocab_size=50, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    model = Transformer(cfg).eval()
    attn = model.model.layers[0].self_attn
    b, t = 2, 11
    x = randn(b, t, cfg.hidden_size, seed=41)
    positions = torch.arange(t).expand(b, t)
    cos, sin = rope_cos_sin(model.inv_freq, positions)
    with torch.no_grad():
        ref = attn(x, positions, cos, sin, None, None)
        q, k, v = attn.project(x)
        q = q.view(b, t, heads, head_dim).transpose(1, 2)
        k = k.view(b, t, kv_heads, head_dim).transpose(1, 2)
        v = v.view(b, t, kv_heads, head_dim).transpose(1, 2)
        out = ch01.gqa_attention(q, k, v, cos, sin)
        assert out.shape == (b, heads, t, head_dim), f"shape {tuple(out.shape)}: [B, H, T, d]"
        got = attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_ch01_gqa_attention_matches_sdpa_and_transformers_rope(ch01):
    q, k, v, cos, sin = attention_inputs(2, 6, 2, 9, 16, seed=42)
    out = ch01.gqa_attention(q, k, v, cos, sin)
    q_rot, k_rot = hf_apply_rotary(q, k, cos, sin)  # transformers' RoPE, same tables
    ref = F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    unrotated = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not torch.allclose(out, unrotated, atol=1e-3), "apply RoPE to q and k"


def test_ch01_gqa_attention_is_causal(ch01):
    """Changing the last token changes no earlier output; token 0 sees only itself."""
    q, k, v, cos, sin = attention_inputs(1, 4, 2, 8, 16, seed=43)
    out = ch01.gqa_attention(q, k, v, cos, sin)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 5.0
    changed = ch01.gqa_attention(q, k2, v2, cos, sin)
    torch.testing.assert_close(
        changed[:, :, :-1], out[:, :, :-1], msg="earlier tokens must not see later ones: mask j > i"
    )
    first = v[:, [0, 0, 1, 1], 0]  # query head h reads kv head h // 2
    torch.testing.assert_close(out[:, :, 0], first, msg="token 0 attends only to itself")


def test_ch01_gqa_attention_query_heads_share_kv_heads_in_groups(ch01):
    """v of kv head j filled with j: query head h must output h // n_rep (weights sum to 1)."""
    q, k, _, cos, sin = attention_inputs(1, 6, 3, 5, 8, seed=44)
    v = torch.arange(3.0).view(1, 3, 1, 1).expand(1, 3, 5, 8).contiguous()
    out = ch01.gqa_attention(q, k, v, cos, sin)
    heads = out[0, :, -1, 0].round().tolist()
    assert heads == [0, 0, 1, 1, 2, 2], (
        f"query heads read kv heads {heads}: expected 0,0,1,1,2,2 (h // n_rep, not h % kv_heads)"
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_ch01_gqa_attention_half_precision_computes_in_fp32(ch01, dtype):
    """Large activations: q . k = 40 * 40 * 64 > 65504 overflows fp16 unless upcast."""
    q, k, v, cos, sin = attention_inputs(1, 2, 1, 6, 64, seed=45)
    q, k = q.sign() * 40, k.sign() * 40
    k[:, :, 3] = q[:, 0, 3]  # one key aligned with a query: a score of 102,400 before scaling
    ref = ch01_reference_attention(q, k, v, cos, sin)
    out = ch01.gqa_attention(q.to(dtype), k.to(dtype), v.to(dtype), cos, sin)
    assert out.dtype == dtype, f"return q's dtype ({dtype}), got {out.dtype}"
    finite = bool(torch.isfinite(out).all())
    assert finite, "nan/inf in the output: compute the scores and the softmax in fp32"
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02)


def ch01_reference_attention(q, k, v, cos, sin):
    """fp32 reference: minillm's apply_rope, then SDPA with grouped-query heads."""
    q, k, v = q.float(), k.float(), v.float()
    q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)


# --- causal_mask ----------------------------------------------------------------------------


def test_ch01_causal_mask_square_is_lower_triangular(ch01):
    mask = ch01.causal_mask(6, 6)
    assert mask.dtype == torch.bool and mask.shape == (6, 6)
    assert torch.equal(mask, torch.ones(6, 6, dtype=torch.bool).tril())
    q, k, v = randn(1, 2, 6, 8, seed=21), randn(1, 2, 6, 8, seed=22), randn(1, 2, 6, 8, seed=23)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )


def test_ch01_causal_mask_decode_step_sees_every_key(ch01):
    assert torch.equal(ch01.causal_mask(1, 7), torch.ones(1, 7, dtype=torch.bool))


def test_ch01_causal_mask_chunk_matches_full_attention(ch01):
    """The last 4 of 9 queries against all 9 keys: the rows of full causal attention."""
    q, k, v = randn(1, 2, 9, 8, seed=24), randn(1, 2, 9, 8, seed=25), randn(1, 2, 9, 8, seed=26)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    chunk = F.scaled_dot_product_attention(q[:, :, 5:], k, v, attn_mask=ch01.causal_mask(4, 9))
    torch.testing.assert_close(chunk, full[:, :, 5:], msg="align the triangle bottom-right")
    with pytest.raises(ValueError):
        ch01.causal_mask(5, 3)


def test_ch01_causal_mask_drives_minillm_transformer(ch01):
    torch.manual_seed(27)
    cfg = ModelConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask=ch01.causal_mask(7, 7)[None, None]), model(ids))


# --- top_p_filter ---------------------------------------------------------------------------


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_ch01_top_p_matches_minillm_and_transformers(ch01, p):
    logits = randn(8, 100, seed=28, scale=2.0)
    before = logits.clone()
    out = ch01.top_p_filter(logits, p)
    assert torch.equal(logits, before), "top_p_filter modified its input"
    assert torch.equal(out, minillm_top_p(logits, p))
    assert torch.equal(out, TopPLogitsWarper(p)(None, logits))


def test_ch01_top_p_hand_computed_example(ch01):
    probs = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])  # vocabulary order, not sorted
    logits = probs.log()
    # sorted: 0.5 (id 1), 0.2 (id 3), 0.15 (id 4), 0.1 (id 2), 0.05 (id 0)
    cases = {0.3: [1], 0.6: [1, 3], 0.75: [1, 3, 4], 0.8: [1, 3, 4], 0.96: [0, 1, 2, 3, 4]}
    for p, expected in cases.items():
        out = ch01.top_p_filter(logits, p)
        assert kept(out) == expected, (
            f"p={p}: kept ids {kept(out)}, expected {expected} (the smallest set of likeliest "
            "tokens whose mass is >= p: the token that crosses p is in the set)"
        )
        assert torch.equal(out[expected], logits[expected]), "kept logits must be unchanged"
        dropped = [i for i in range(5) if i not in expected]
        assert (out[dropped] == float("-inf")).all(), "dropped logits must be -inf"


def test_ch01_top_p_one_keeps_every_token(ch01):
    # Row 0: four tokens of probability exactly 0.25 sum to exactly 1.0 in fp32, and
    # exp(-200) underflows to 0, so a running sum reaches p=1 before the last two tokens.
    logits = torch.tensor([[0.0, -200.0, 0.0, -300.0, 0.0, 0.0], [1.0, 5.0, 0.0, -1.0, 2.0, 3.0]])
    out = ch01.top_p_filter(logits, 1.0)
    assert torch.equal(out, logits), "p=1 must keep every token, even those with probability 0"


def test_ch01_top_p_tiny_p_keeps_only_the_argmax(ch01):
    logits = randn(6, 50, seed=29)
    out = ch01.top_p_filter(logits, 1e-6)
    finite = torch.isfinite(out)
    assert (finite.sum(-1) == 1).all(), "a tiny p must keep exactly one token per row"
    assert torch.equal(finite.float().argmax(-1), logits.argmax(-1))


def test_ch01_top_p_ties(ch01):
    flat = torch.zeros(8)  # 8 tokens of probability 0.125
    assert len(kept(ch01.top_p_filter(flat, 0.3))) == 3, "0.25 < 0.3 <= 0.375: keep 3 of 8"
    two_tops = torch.tensor([2.0, 2.0, 0.0, 0.0])  # probabilities 0.44, 0.44, 0.06, 0.06
    assert kept(ch01.top_p_filter(two_tops, 0.5)) == [0, 1]
    one = kept(ch01.top_p_filter(two_tops, 0.4))
    assert len(one) == 1 and one[0] in (0, 1), f"p=0.4 needs one of the tied tops, kept {one}"


def test_ch01_top_p_rows_are_independent(ch01):
    rows = torch.stack([randn(30, seed=30, scale=5.0), randn(30, seed=31, scale=0.1)])
    rows = torch.cat([rows, torch.zeros(1, 30)])  # peaked, nearly flat, flat
    out = ch01.top_p_filter(rows, 0.72)
    for r in range(3):
        assert torch.equal(out[r], ch01.top_p_filter(rows[r], 0.72)), f"row {r} depends on others"
    # flat: 21/30 = 0.7 < 0.72 <= 22/30
    assert len(kept(out[0])) < len(kept(out[1])) <= len(kept(out[2])) == 22
    batched = ch01.top_p_filter(rows.view(3, 1, 30).expand(3, 2, 30), 0.72)  # [..., vocab]
    assert torch.equal(batched, out[:, None].expand(3, 2, 30))


def test_ch01_top_p_after_top_k(ch01):
    logits = top_k_filter(randn(4, 40, seed=32, scale=2.0), 10)  # already holds -inf
    out = ch01.top_p_filter(logits, 0.8)
    assert not out.isnan().any()
    assert torch.equal(out, minillm_top_p(logits, 0.8))


def test_ch01_top_p_rejects_p_outside_0_1(ch01):
    for p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            ch01.top_p_filter(torch.zeros(4), p)
