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

from exercises.feedback import assert_close, worst
from minillm.generation.sampling import top_k_filter
from minillm.generation.sampling import top_p_filter as minillm_top_p
from minillm.model import ModelConfig, Transformer
from minillm.model.transformer import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- rms_norm -------------------------------------------------------------------------------


RMS_REFERENCES = ("minillm's RMSNorm", "transformers' LlamaRMSNorm")
RMS_HINT = (
    "y = weight * x / sqrt(mean(x**2 over the last dim) + eps): no mean subtraction (that "
    "is LayerNorm), eps inside the sqrt; normalise in fp32, cast back, then multiply by weight"
)


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
    case = f"rms_norm(fp32 x {list(shape)}, eps={eps})"
    assert out.shape == x.shape, (
        f"{case}: expected shape {tuple(x.shape)}, got {tuple(out.shape)}; hint: reduce over "
        "the last dim only with keepdim=True (mean(-1, keepdim=True)) so it broadcasts back"
    )
    assert out.dtype == torch.float32, (
        f"{case}: expected dtype torch.float32, got {out.dtype}; hint: compute in fp32 and "
        "cast the normalised vector back to x.dtype"
    )
    refs = references_rms_norm(x, weight, eps)
    for name, ref in zip(RMS_REFERENCES, refs, strict=True):
        assert_close(out, ref, f"{case} vs {name}", RMS_HINT, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)], ids=["fp16", "bf16"]
)
def test_ch01_rms_norm_half_precision_matches_references(ch01, dtype, tol):
    """A half-precision model: x and weight both fp16/bf16, the result in that dtype."""
    x, weight = randn(3, 96, seed=3, scale=4.0).to(dtype), randn(96, seed=4).to(dtype)
    out = ch01.rms_norm(x, weight, 1e-5)
    case = f"rms_norm({dtype} x [3, 96] and weight, eps=1e-5)"
    assert out.dtype == dtype, (
        f"{case}: expected dtype {dtype}, got {out.dtype}; hint: cast the normalised fp32 "
        "vector back to x.dtype before multiplying by weight"
    )
    refs = references_rms_norm(x, weight, 1e-5)
    for name, ref in zip(RMS_REFERENCES, refs, strict=True):
        assert_close(out, ref, f"{case} vs {name}", RMS_HINT, rtol=tol, atol=tol)


def test_ch01_rms_norm_fp16_large_activations_need_fp32(ch01):
    """|x| in the thousands is fine in fp16, but x**2 is not (max 65504): square in fp32."""
    x = randn(4, 64, seed=5, scale=1000.0).half()
    assert x.isfinite().all()
    weight = torch.ones(64, dtype=torch.float16)
    out = ch01.rms_norm(x, weight, 1e-6)
    case = "rms_norm(fp16 x [4, 64] of magnitude ~1000, weight 1, eps=1e-6)"
    hint = (
        "x**2 overflows fp16 (max 65504): compute the mean of squares in fp32 (x.float()) "
        "and cast back at the end"
    )
    assert out.isfinite().all(), (
        f"{case}: expected finite values, got {int((~out.isfinite()).sum())} inf/nan of "
        f"{out.numel()}; hint: {hint}"
    )
    assert out.abs().max() > 0.5, (
        f"{case}: expected values of unit RMS (max |y| > 0.5), got max |y| = "
        f"{float(out.abs().max()):.3g}; hint: {hint}"
    )
    expected = (x.double() / x.double().pow(2).mean(-1, keepdim=True).sqrt()).half()
    assert_close(out, expected, f"{case} vs fp64", hint, rtol=2e-3, atol=2e-3)


def test_ch01_rms_norm_eps_goes_inside_the_square_root(ch01):
    x, weight = torch.full((2, 8), 1e-3), torch.ones(8)
    out = ch01.rms_norm(x, weight, 1e-2)
    expected = torch.full((2, 8), 1e-3 / math.sqrt(1e-6 + 1e-2))  # ~0.01, not 1e-3/(1e-3+1e-2)
    assert_close(
        out,
        expected,
        "rms_norm(x all 1e-3, weight 1, eps=1e-2)",
        "y = x / sqrt(mean(x**2) + eps): eps goes inside the square root, not x / (rms + eps)",
    )
    zeros = ch01.rms_norm(torch.zeros(3, 8), weight, 1e-6)
    assert torch.equal(zeros, torch.zeros(3, 8)), (
        f"rms_norm(all-zero x [3, 8], eps=1e-6): {worst(zeros, torch.zeros(3, 8))}; hint: add "
        "eps to the mean of squares inside the sqrt, so 0 / sqrt(0 + eps) = 0, not 0/0 = nan"
    )
    x = randn(5, 16, seed=6, scale=0.1)
    for eps in (0.0, 0.5):  # eps must be the argument, not a constant
        assert_close(
            ch01.rms_norm(x, torch.ones(16), eps),
            RMSNorm(16, eps)(x),
            f"rms_norm(x [5, 16] of scale 0.1, weight 1, eps={eps}) vs minillm's RMSNorm",
            "use the eps argument, not a constant such as 1e-6",
        )


def test_ch01_rms_norm_gives_unit_rms_and_per_channel_gain(ch01):
    x, weight = randn(6, 32, seed=7, scale=3.0), randn(32, seed=8)
    unit = ch01.rms_norm(x, torch.ones(32), 0.0)
    rms = unit.pow(2).mean(-1).sqrt()
    assert_close(
        rms,
        torch.ones(6),
        "RMS of each row of rms_norm(x [6, 32], weight 1, eps=0)",
        "each row must come out with RMS 1: divide by the RMS of its own last dim only",
    )
    assert_close(
        ch01.rms_norm(7.0 * x, torch.ones(32), 0.0),
        unit,
        "rms_norm(7 * x) vs rms_norm(x) (weight 1, eps=0)",
        "RMSNorm is scale-free: divide each row by its own RMS, add or subtract nothing",
    )
    assert_close(
        ch01.rms_norm(x, weight, 0.0),
        unit * weight,
        "rms_norm(x, weight) vs rms_norm(x, 1) * weight (eps=0)",
        "multiply channel i by weight[i] after normalising (weight broadcasts over the last dim)",
    )


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
    case = f"rope_frequencies(head_dim={head_dim}, theta={theta:g})"
    assert inv_freq.shape == (head_dim // 2,), (
        f"{case}: expected shape ({head_dim // 2},), got {tuple(inv_freq.shape)}; hint: one "
        "frequency per channel pair, i = 0 .. head_dim/2 - 1 (torch.arange(0, head_dim, 2))"
    )
    assert inv_freq.dtype == torch.float32, (
        f"{case}: expected dtype torch.float32, got {inv_freq.dtype}; hint: build the "
        "exponents in float32 (torch.arange(..., dtype=torch.float32))"
    )
    hint = (
        "inv_freq[i] = 1 / theta ** (2 * i / head_dim), the exponent in floating point "
        "(2 * i // head_dim makes every exponent 0)"
    )
    assert_close(inv_freq, minillm_inv_freq(head_dim, theta), f"{case} vs minillm", hint)
    assert_close(inv_freq, hf_rope(head_dim, theta).inv_freq, f"{case} vs transformers", hint)
    assert inv_freq[0] == 1.0, (
        f"{case}: expected inv_freq[0] = 1.0 (theta ** 0), got {float(inv_freq[0]):.6g}; hint: "
        "the exponents start at 0"
    )
    assert (inv_freq[1:] < inv_freq[:-1]).all(), (
        f"{case}: expected strictly decreasing frequencies, got "
        f"{[round(f, 5) for f in inv_freq[:4].tolist()]} ...; hint: {hint}"
    )


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
    case = f"apply_rotary(x [2, 3, 5, 16], positions {list(positions.shape)}, theta={theta:g})"
    assert out.shape == x.shape, (
        f"{case}: expected shape {tuple(x.shape)}, got {tuple(out.shape)}; hint: cos/sin are "
        "[B, T, d]: insert the heads axis ([:, None]) so they broadcast over x [B, H, T, d]"
    )
    assert out.dtype == x.dtype, (
        f"{case}: expected dtype {x.dtype}, got {out.dtype}; hint: return .to(x.dtype)"
    )
    hint = (
        "pair channel i with i + head_dim/2: x * cos + cat(-x2, x1) * sin, the angles "
        "positions x inv_freq written twice (cat(angles, angles))"
    )
    want = minillm_rotary(x, positions, theta)
    assert_close(out, want, f"{case} vs minillm", hint, rtol=1e-5, atol=1e-5)
    cos, sin = hf_rope(16, theta)(x, positions.expand(2, -1))
    hf_out, _ = hf_apply_rotary(x, x, cos, sin)
    assert_close(out, hf_out, f"{case} vs transformers", hint, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float16, 1e-2), (torch.bfloat16, 6e-2)], ids=["fp16", "bf16"]
)
def test_ch01_apply_rotary_half_precision_keeps_angles_in_fp32(ch01, dtype, tol):
    """Positions 3000+ are not exact in fp16/bf16: angles must be computed in fp32."""
    x = randn(1, 2, 8, 32, seed=10).to(dtype)
    positions = torch.arange(3001, 3009)
    out = ch01.apply_rotary(x, positions, 10000.0)
    case = f"apply_rotary({dtype} x [1, 2, 8, 32], positions 3001..3008)"
    assert out.dtype == dtype, (
        f"{case}: expected dtype {dtype}, got {out.dtype}; hint: compute in fp32, then cast "
        "the result back with .to(x.dtype)"
    )
    expected = minillm_rotary(x.float(), positions, 10000.0).to(dtype)
    assert_close(
        out,
        expected,
        f"{case} vs the fp32 result",
        f"compute the angles positions x inv_freq in fp32: {dtype} cannot hold 3001 exactly",
        rtol=tol,
        atol=tol,
    )


def test_ch01_apply_rotary_position_zero_is_identity(ch01):
    x = randn(2, 2, 4, 8, seed=11)
    assert_close(
        ch01.apply_rotary(x, torch.zeros(4, dtype=torch.long)),
        x,
        "apply_rotary(x [2, 2, 4, 8], positions all 0)",
        "at position 0 every angle is 0 (cos 1, sin 0): x must come back unchanged; use the "
        "positions as given, without an offset",
    )


def test_ch01_apply_rotary_preserves_each_pair_norm(ch01):
    """A rotation keeps lengths: pair (i, i + d/2) has the same norm after RoPE."""
    d = 32
    x = randn(2, 2, 6, d, seed=12)
    positions = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(13))
    out = ch01.apply_rotary(x, positions)

    def pair_norms(t: torch.Tensor) -> torch.Tensor:
        return torch.hypot(t[..., : d // 2], t[..., d // 2 :])

    assert_close(
        pair_norms(out),
        pair_norms(x),
        "norm of each pair (i, i + d/2) after apply_rotary(x [2, 2, 6, 32], random positions)",
        "a rotation keeps lengths: channel i pairs with i + head_dim/2 (HF's rotate-half "
        "layout, not (2i, 2i+1)), and cos and sin of a pair use the same angle",
        rtol=1e-4,
        atol=1e-5,
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
            f"apply_rotary: q at position n + {distance}, k at n, for n = 0, 5, 100, 777: "
            f"expected the same q·k each time, got {[round(s, 4) for s in scores.tolist()]}; "
            "hint: rotate q and k by the same frequencies and pairing, so q·k depends on m - n"
        )
    moved, still = score(3, 0), score(0, 0)
    assert (moved - still).abs() > 1e-3 * scale, (
        f"apply_rotary: expected q at position 3 to score differently against k at 0 than q "
        f"at 0 does, got {float(moved):.6g} and {float(still):.6g}; hint: the angle must grow "
        "with the position (positions x inv_freq)"
    )


def test_ch01_apply_rotary_offset_positions_match_the_full_sequence(ch01):
    """What chapter 02's KV cache relies on: tokens 6..9 alone, at positions 6..9,
    rotate exactly as they do inside the whole sequence; and each row of a batch
    uses its own positions."""
    x = randn(2, 2, 10, 16, seed=16)
    full = ch01.apply_rotary(x, torch.arange(10))
    tail = ch01.apply_rotary(x[:, :, 6:], torch.arange(6, 10))
    assert_close(
        tail,
        full[:, :, 6:],
        "apply_rotary(tokens 6..9 alone, positions 6..9) vs the same tokens in the sequence",
        "rotate by the positions given, not 0..T-1 of the slice (a KV cache feeds tokens at "
        "their absolute positions)",
    )
    positions = torch.stack([torch.arange(10), torch.arange(10) + 50])
    batched = ch01.apply_rotary(x, positions)
    for b in range(2):
        alone = ch01.apply_rotary(x[b : b + 1], positions[b])
        assert_close(
            batched[b : b + 1],
            alone,
            f"apply_rotary(x [2, 2, 10, 16], positions [2, 10]): row {b} vs that row alone",
            "positions [B, T] give each row its own angles: [B, 1, T, d] against x [B, H, T, d]",
        )


# --- repeat_kv ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_rep", [1, 2, 3])
def test_ch01_repeat_kv_matches_transformers(ch01, n_rep):
    x = randn(2, 2, 5, 8, seed=17)
    out = ch01.repeat_kv(x, n_rep)
    case = f"repeat_kv(x [2, 2, 5, 8], n_rep={n_rep})"
    assert out.shape == (2, 2 * n_rep, 5, 8), (
        f"{case}: expected shape {(2, 2 * n_rep, 5, 8)}, got {tuple(out.shape)}; hint: repeat "
        "dim 1 (the kv heads) n_rep times, nothing else"
    )
    assert_close(
        out,
        hf_repeat_kv(x, n_rep),
        f"{case} vs transformers",
        "query head h reads kv head h // n_rep: 0, 0, 1, 1 (x.repeat tiles 0, 1, 0, 1)",
        rtol=0,
        atol=0,
    )


def test_ch01_repeat_kv_keeps_groups_together(ch01):
    x = torch.arange(3.0).view(1, 3, 1, 1).expand(1, 3, 2, 4)  # kv head h is filled with h
    heads = ch01.repeat_kv(x, 2)[0, :, 0, 0].tolist()
    assert heads == [0, 0, 1, 1, 2, 2], (
        f"repeat_kv(3 kv heads, n_rep=2): expected query heads to read kv heads "
        f"[0, 0, 1, 1, 2, 2], got {heads}; hint: x.repeat tiles 0, 1, 2, 0, 1, 2: add an "
        "axis after the kv heads, expand it, then reshape (or repeat_interleave on dim 1)"
    )


def test_ch01_repeat_kv_attention_matches_sdpa_gqa(ch01):
    q = randn(1, 6, 5, 8, seed=18)
    k, v = randn(1, 2, 5, 8, seed=19), randn(1, 2, 5, 8, seed=20)
    out = F.scaled_dot_product_attention(
        q, ch01.repeat_kv(k, 3), ch01.repeat_kv(v, 3), is_causal=True
    )
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(
        out,
        ref,
        "SDPA over repeat_kv(k, 3), repeat_kv(v, 3) (6 heads, 2 kv heads) vs enable_gqa=True",
        "query head h reads kv head h // n_rep: 0, 0, 0, 1, 1, 1, not 0, 1, 0, 1, 0, 1",
    )


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


GQA_HINT = (
    "RoPE on q and k (rotate half, cos/sin[:, None]), kv head h // n_rep for query head h, "
    "scores / sqrt(head_dim), -inf where key j > query i, then softmax over the keys"
)


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
        case = f"gqa_attention({heads} heads, {kv_heads} kv heads, head_dim {head_dim})"
        assert out.shape == (b, heads, t, head_dim), (
            f"{case}: expected shape {(b, heads, t, head_dim)}, got {tuple(out.shape)}; hint: "
            "one output per query head, [B, H, T, d]: repeat k and v up to H heads"
        )
        got = attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    assert_close(
        got, ref, f"o_proj of {case} vs minillm's Attention", GQA_HINT, rtol=1e-4, atol=1e-5
    )


def test_ch01_gqa_attention_matches_sdpa_and_transformers_rope(ch01):
    q, k, v, cos, sin = attention_inputs(2, 6, 2, 9, 16, seed=42)
    out = ch01.gqa_attention(q, k, v, cos, sin)
    q_rot, k_rot = hf_apply_rotary(q, k, cos, sin)  # transformers' RoPE, same tables
    ref = F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)
    case = "gqa_attention(B 2, 6 heads, 2 kv heads, 9 tokens, d 16)"
    assert_close(
        out, ref, f"{case} vs SDPA after transformers' RoPE", GQA_HINT, rtol=1e-4, atol=1e-5
    )
    unrotated = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not torch.allclose(out, unrotated, atol=1e-3), (
        f"{case}: expected a result different from attention without RoPE, got the unrotated "
        "one; hint: rotate q and k with cos and sin before computing the scores"
    )


def test_ch01_gqa_attention_is_causal(ch01):
    """Changing the last token changes no earlier output; token 0 sees only itself."""
    q, k, v, cos, sin = attention_inputs(1, 4, 2, 8, 16, seed=43)
    out = ch01.gqa_attention(q, k, v, cos, sin)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 5.0
    changed = ch01.gqa_attention(q, k2, v2, cos, sin)
    assert_close(
        changed[:, :, :-1],
        out[:, :, :-1],
        "gqa_attention: outputs of tokens 0..6 after a change to token 7's k and v only",
        "earlier tokens must not see later ones: scores of key j > query i set to -inf "
        "(triu(1)) before the softmax",
    )
    first = v[:, [0, 0, 1, 1], 0]  # query head h reads kv head h // 2
    assert_close(
        out[:, :, 0],
        first,
        "gqa_attention(4 heads, 2 kv heads): token 0's output vs its own value vector",
        "token 0 attends only to itself (softmax over one key), and query head h reads kv "
        "head h // n_rep",
    )


def test_ch01_gqa_attention_query_heads_share_kv_heads_in_groups(ch01):
    """v of kv head j filled with j: query head h must output h // n_rep (weights sum to 1)."""
    q, k, _, cos, sin = attention_inputs(1, 6, 3, 5, 8, seed=44)
    v = torch.arange(3.0).view(1, 3, 1, 1).expand(1, 3, 5, 8).contiguous()
    out = ch01.gqa_attention(q, k, v, cos, sin)
    heads = out[0, :, -1, 0].round().tolist()
    assert heads == [0, 0, 1, 1, 2, 2], (
        f"gqa_attention(6 heads, 3 kv heads, v of kv head j filled with j): expected query "
        f"heads to read kv heads [0, 0, 1, 1, 2, 2], got {heads}; hint: query head h reads kv "
        "head h // n_rep, not h % kv_heads"
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_ch01_gqa_attention_half_precision_computes_in_fp32(ch01, dtype):
    """Large activations: q . k = 40 * 40 * 64 > 65504 overflows fp16 unless upcast."""
    q, k, v, cos, sin = attention_inputs(1, 2, 1, 6, 64, seed=45)
    q, k = q.sign() * 40, k.sign() * 40
    k[:, :, 3] = q[:, 0, 3]  # one key aligned with a query: a score of 102,400 before scaling
    ref = ch01_reference_attention(q, k, v, cos, sin)
    out = ch01.gqa_attention(q.to(dtype), k.to(dtype), v.to(dtype), cos, sin)
    case = f"gqa_attention({dtype} q, k, v with |q . k| up to 102,400)"
    hint = "upcast q, k, v to fp32 for RoPE, the scores and the softmax; cast only the output"
    assert out.dtype == dtype, f"{case}: expected q's dtype {dtype}, got {out.dtype}; hint: {hint}"
    finite = bool(torch.isfinite(out).all())
    assert finite, (
        f"{case}: expected finite values, got {int((~torch.isfinite(out)).sum())} nan/inf of "
        f"{out.numel()}; hint: {hint} (fp16 overflows past 65504)"
    )
    assert_close(out.float(), ref, f"{case} vs fp32", hint, rtol=0.02, atol=0.02)


def ch01_reference_attention(q, k, v, cos, sin):
    """fp32 reference: minillm's apply_rope, then SDPA with grouped-query heads."""
    q, k, v = q.float(), k.float(), v.float()
    q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)


# --- causal_mask ----------------------------------------------------------------------------


def test_ch01_causal_mask_square_is_lower_triangular(ch01):
    mask = ch01.causal_mask(6, 6)
    assert mask.dtype == torch.bool, (
        f"causal_mask(6, 6): expected dtype torch.bool, got {mask.dtype}; hint: compare "
        "positions (key <= query) to get a bool mask, True = attend"
    )
    assert mask.shape == (6, 6), (
        f"causal_mask(6, 6): expected shape (6, 6), got {tuple(mask.shape)}; hint: "
        "[q_len, kv_len], no batch or head axes"
    )
    assert torch.equal(mask, torch.ones(6, 6, dtype=torch.bool).tril()), (
        f"causal_mask(6, 6): expected the lower triangle (True where key j <= query i), got "
        f"{mask.int().tolist()}; hint: True means attend (SDPA's convention), not masked"
    )
    q, k, v = randn(1, 2, 6, 8, seed=21), randn(1, 2, 6, 8, seed=22), randn(1, 2, 6, 8, seed=23)
    assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "SDPA with attn_mask=causal_mask(6, 6) vs is_causal=True",
        "a bool attn_mask means True = attend",
    )


def test_ch01_causal_mask_decode_step_sees_every_key(ch01):
    mask = ch01.causal_mask(1, 7)
    assert torch.equal(mask, torch.ones(1, 7, dtype=torch.bool)), (
        f"causal_mask(1, 7): expected one row of 7 True (a decode query sees every key), got "
        f"{mask.int().tolist()}; hint: query i sits at position kv_len - q_len + i: align the "
        "triangle bottom-right (is_causal aligns it top-left)"
    )


def test_ch01_causal_mask_chunk_matches_full_attention(ch01):
    """The last 4 of 9 queries against all 9 keys: the rows of full causal attention."""
    q, k, v = randn(1, 2, 9, 8, seed=24), randn(1, 2, 9, 8, seed=25), randn(1, 2, 9, 8, seed=26)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    chunk = F.scaled_dot_product_attention(q[:, :, 5:], k, v, attn_mask=ch01.causal_mask(4, 9))
    assert_close(
        chunk,
        full[:, :, 5:],
        "SDPA of the last 4 of 9 queries with causal_mask(4, 9) vs those rows of full attention",
        "query i is at position kv_len - q_len + i: mask[i, j] = j <= i + (kv_len - q_len), "
        "the triangle aligned bottom-right",
    )
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
        assert_close(
            model(ids, mask=ch01.causal_mask(7, 7)[None, None]),
            model(ids),
            "minillm's Transformer logits with mask=causal_mask(7, 7)[None, None] vs without",
            "a bool mask [q_len, kv_len], True where key j <= query i (True = attend)",
        )


# --- top_p_filter ---------------------------------------------------------------------------


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def rounded(t: torch.Tensor) -> list[float]:
    return [round(x, 4) for x in t.flatten().tolist()]


def kept_per_row(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).sum(-1).tolist()


TOP_P_HINT = (
    "keep the smallest set of likeliest tokens whose mass is >= p (the token that crosses p "
    "is in it), scattered back to vocabulary order; the rest -inf, kept logits unchanged"
)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_ch01_top_p_matches_minillm_and_transformers(ch01, p):
    logits = randn(8, 100, seed=28, scale=2.0)
    before = logits.clone()
    out = ch01.top_p_filter(logits, p)
    case = f"top_p_filter(logits [8, 100], p={p})"
    assert torch.equal(logits, before), (
        f"{case} modified its input: {worst(logits, before)}; hint: return a new tensor "
        "(masked_fill, not masked_fill_ on logits)"
    )
    for name, ref in [
        ("minillm's top_p_filter", minillm_top_p(logits, p)),
        ("transformers' TopPLogitsWarper", TopPLogitsWarper(p)(None, logits)),
    ]:
        assert torch.equal(out, ref), (
            f"{case} vs {name}: expected {kept_per_row(ref)} tokens kept per row, got "
            f"{kept_per_row(out)} ({worst(out, ref)}); hint: {TOP_P_HINT}"
        )


def test_ch01_top_p_hand_computed_example(ch01):
    probs = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])  # vocabulary order, not sorted
    logits = probs.log()
    # sorted: 0.5 (id 1), 0.2 (id 3), 0.15 (id 4), 0.1 (id 2), 0.05 (id 0)
    cases = {0.3: [1], 0.6: [1, 3], 0.75: [1, 3, 4], 0.8: [1, 3, 4], 0.96: [0, 1, 2, 3, 4]}
    for p, expected in cases.items():
        out = ch01.top_p_filter(logits, p)
        case = f"top_p_filter(log of probs [0.05, 0.5, 0.1, 0.2, 0.15], p={p})"
        assert kept(out) == expected, (
            f"{case}: expected ids {expected} kept, got {kept(out)}; hint: the smallest set of "
            "likeliest tokens whose mass is >= p: the token that crosses p is in the set"
        )
        assert torch.equal(out[expected], logits[expected]), (
            f"{case}: expected the kept logits unchanged, {rounded(logits[expected])}, got "
            f"{rounded(out[expected])}; hint: do not renormalise or return probabilities"
        )
        dropped = [i for i in range(5) if i not in expected]
        assert (out[dropped] == float("-inf")).all(), (
            f"{case}: expected -inf at the dropped ids {dropped}, got {rounded(out[dropped])}; "
            "hint: set dropped tokens to float('-inf'), not 0 or nan"
        )


def test_ch01_top_p_one_keeps_every_token(ch01):
    # Row 0: four tokens of probability exactly 0.25 sum to exactly 1.0 in fp32, and
    # exp(-200) underflows to 0, so a running sum reaches p=1 before the last two tokens.
    logits = torch.tensor([[0.0, -200.0, 0.0, -300.0, 0.0, 0.0], [1.0, 5.0, 0.0, -1.0, 2.0, 3.0]])
    out = ch01.top_p_filter(logits, 1.0)
    assert torch.equal(out, logits), (
        f"top_p_filter(logits [2, 6] with probabilities exactly 0.25 and 0, p=1.0): expected "
        f"every token kept unchanged: {worst(out, logits)}; hint: return a copy early when "
        "p == 1: probabilities that underflow to 0 let the running sum reach 1.0 too soon"
    )


def test_ch01_top_p_tiny_p_keeps_only_the_argmax(ch01):
    logits = randn(6, 50, seed=29)
    out = ch01.top_p_filter(logits, 1e-6)
    finite = torch.isfinite(out)
    case = "top_p_filter(logits [6, 50], p=1e-6)"
    assert (finite.sum(-1) == 1).all(), (
        f"{case}: expected 1 token kept per row, got {finite.sum(-1).tolist()}; hint: drop a "
        "token when the mass ranked above it is >= p, so the likeliest token always stays"
    )
    assert torch.equal(finite.float().argmax(-1), logits.argmax(-1)), (
        f"{case}: expected the argmax ids {logits.argmax(-1).tolist()} kept, got "
        f"{finite.float().argmax(-1).tolist()}; hint: scatter the decision from sorted order "
        "back to vocabulary order with the sort's indices"
    )


def test_ch01_top_p_ties(ch01):
    flat = torch.zeros(8)  # 8 tokens of probability 0.125
    three = kept(ch01.top_p_filter(flat, 0.3))
    assert len(three) == 3, (
        f"top_p_filter(8 equal logits, p=0.3): expected 3 tokens kept (0.25 < 0.3 <= 0.375), "
        f"got {len(three)}: {three}; hint: keep ties only as far as the mass needs"
    )
    two_tops = torch.tensor([2.0, 2.0, 0.0, 0.0])  # probabilities 0.44, 0.44, 0.06, 0.06
    two = kept(ch01.top_p_filter(two_tops, 0.5))
    assert two == [0, 1], (
        f"top_p_filter(logits [2, 2, 0, 0], p=0.5): expected ids [0, 1] kept (0.44 < 0.5), "
        f"got {two}; hint: {TOP_P_HINT}"
    )
    one = kept(ch01.top_p_filter(two_tops, 0.4))
    case = "top_p_filter(logits [2, 2, 0, 0], p=0.4)"
    assert len(one) == 1, (
        f"{case}: expected 1 of the tied tops kept (0.44 >= 0.4), got {one}; hint: keep ties "
        "only as far as the mass needs: drop a token when the mass ranked above it is >= p"
    )
    assert one[0] in (0, 1), f"{case}: expected id 0 or 1 kept, got {one}; hint: {TOP_P_HINT}"


def test_ch01_top_p_rows_are_independent(ch01):
    rows = torch.stack([randn(30, seed=30, scale=5.0), randn(30, seed=31, scale=0.1)])
    rows = torch.cat([rows, torch.zeros(1, 30)])  # peaked, nearly flat, flat
    out = ch01.top_p_filter(rows, 0.72)
    case = "top_p_filter(peaked, nearly flat and flat rows [3, 30], p=0.72)"
    hint = "softmax, sort and cumsum along the last dim only (dim=-1), never the whole tensor"
    for r in range(3):
        alone = ch01.top_p_filter(rows[r], 0.72)
        assert torch.equal(out[r], alone), (
            f"{case}: row {r} kept {len(kept(out[r]))} tokens, alone {len(kept(alone))} "
            f"({worst(out[r], alone)}); hint: {hint}"
        )
    # flat: 21/30 = 0.7 < 0.72 <= 22/30
    assert len(kept(out[0])) < len(kept(out[1])) <= len(kept(out[2])) == 22, (
        f"{case}: expected fewer tokens kept the more peaked a row, 22 for the flat one "
        f"(21/30 < 0.72 <= 22/30), got {[len(kept(out[r])) for r in range(3)]}; hint: {TOP_P_HINT}"
    )
    batched = ch01.top_p_filter(rows.view(3, 1, 30).expand(3, 2, 30), 0.72)  # [..., vocab]
    want = out[:, None].expand(3, 2, 30)
    assert torch.equal(batched, want), (
        f"top_p_filter(logits [3, 2, 30], p=0.72) vs the rows filtered as [3, 30]: "
        f"{worst(batched, want)}; hint: {hint}, so any leading dims work"
    )


def test_ch01_top_p_after_top_k(ch01):
    logits = top_k_filter(randn(4, 40, seed=32, scale=2.0), 10)  # already holds -inf
    out = ch01.top_p_filter(logits, 0.8)
    case = "top_p_filter(logits [4, 40] after a top-10 cut (30 of them -inf), p=0.8)"
    assert not out.isnan().any(), (
        f"{case}: expected no nan, got {int(out.isnan().sum())}; hint: softmax gives -inf "
        "probability 0; avoid arithmetic on the logits themselves (-inf - -inf = nan)"
    )
    ref = minillm_top_p(logits, 0.8)
    assert torch.equal(out, ref), (
        f"{case} vs minillm: expected {kept_per_row(ref)} tokens kept per row, got "
        f"{kept_per_row(out)} ({worst(out, ref)}); hint: {TOP_P_HINT}"
    )


def test_ch01_top_p_rejects_p_outside_0_1(ch01):
    for p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            ch01.top_p_filter(torch.zeros(4), p)
