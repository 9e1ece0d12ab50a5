"""minillm.quant: exact packing, bounded rounding error, the NF4 table and bitsandbytes' NF4,
QuantLinear against its own dequantized weight, and a quantized bundled model that still
predicts like the fp32 one."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from torch import nn

from minillm import quant
from minillm.model import load_model, load_tokenizer
from minillm.quant import (
    QuantLinear,
    absmax_quantize,
    dequantize,
    quantize_int4,
    quantize_model,
    quantize_nf4,
    zeropoint_quantize,
)
from minillm.quant.formats import NF4_CODE, pack_int4, unpack_int4
from minillm.training import held_out_ids, next_token_agreement, perplexity


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------ packing


def test_pack_unpack_round_trip_is_exact_for_every_code_pair():
    codes = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).flatten()
    packed = pack_int4(codes.view(16, 32))
    assert packed.shape == (16, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes.view(16, 32))
    assert torch.equal(torch.unique(packed), torch.arange(256, dtype=torch.uint8))  # all bytes


def test_pack_puts_the_even_element_in_the_low_nibble():
    assert pack_int4(torch.tensor([[0x3, 0xA]], dtype=torch.uint8)).item() == 0xA3


def test_pack_rejects_odd_length_and_out_of_range_codes():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_int4(torch.full((2, 4), 16, dtype=torch.uint8))


# ------------------------------------------------------------------------ INT8 and INT4


@pytest.mark.parametrize("per_channel", [True, False])
def test_absmax_int8_error_is_at_most_half_a_step(per_channel):
    w = randn(64, 96) * torch.linspace(0.1, 3, 64)[:, None]  # rows of very different ranges
    q, scale = absmax_quantize(w, 8, per_channel)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert scale.numel() == (64 if per_channel else 1)
    err = (dequantize(q, scale) - w).abs()
    assert (err <= scale / 2 + 1e-6).all()


def test_per_channel_beats_per_tensor_when_rows_differ_in_range():
    w = randn(64, 96) * torch.logspace(-2, 0, 64)[:, None]
    per_row = dequantize(*absmax_quantize(w, 8, True))
    per_tensor = dequantize(*absmax_quantize(w, 8, False))
    assert rel_err(per_row, w) < rel_err(per_tensor, w) / 2


def test_zeropoint_int8_uses_the_full_range_and_represents_zero_exactly():
    w = randn(32, 64).abs() + 0.5  # all positive: symmetric wastes half of its codes
    w[:, 0] = 0.0
    q, scale, zero = zeropoint_quantize(w, 8, True)
    deq = dequantize(q, scale, zero)
    assert q.dtype == torch.uint8 and int(q.max()) == 255
    assert (deq[:, 0] == 0).all()
    assert rel_err(deq, w) < rel_err(dequantize(*absmax_quantize(w, 8, True)), w)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_groupwise_error_is_bounded_by_the_group_step(group_size, symmetric):
    w = randn(48, 256)
    qw = quantize_int4(w, group_size, symmetric)
    assert qw.packed.shape == (48, 128) and qw.scale.shape == (48, 256 // group_size)
    step = qw.scale.float().repeat_interleave(group_size, dim=1)
    err = (qw.dequantize() - w).abs() / step
    # symmetric: half a step; asymmetric: the integer zero point shifts the grid by up to
    # half a step, so a group's extreme value can be clamped up to one step away
    assert err.max() <= (0.5 if symmetric else 1.0) * (1 + 1e-3)
    assert err.mean() < 0.3


def test_smaller_groups_give_smaller_error():
    w = randn(64, 256) * (1 + 5 * (torch.rand(64, 256) > 0.99))  # a few large weights
    errors = [rel_err(quantize_int4(w, g).dequantize(), w) for g in (256, 128, 64, 32)]
    assert errors == sorted(errors, reverse=True), errors


def test_group_size_that_does_not_divide_names_the_fix():
    with pytest.raises(ValueError, match=r"not divisible by group_size=128.*\[32, 64\]"):
        quantize_int4(randn(8, 192), 128)
    with pytest.raises(ValueError, match="keep"):
        quantize_nf4(randn(8, 100), 64)


# ------------------------------------------------------------------------------------ NF4


def test_nf4_table_is_rebuilt_from_normal_quantiles():
    assert torch.allclose(quant.nf4_code_from_normal(), NF4_CODE, atol=1e-6)
    assert NF4_CODE[7] == 0 and NF4_CODE[0] == -1 and NF4_CODE[-1] == 1


def test_nf4_picks_the_nearest_code():
    w = randn(16, 64)
    qw = quantize_nf4(w, 64)
    normed = w / qw.absmax.repeat_interleave(64, dim=1)
    nearest = (normed[..., None] - NF4_CODE).abs().argmin(-1)
    assert torch.equal(unpack_int4(qw.packed).long(), nearest)


def test_nf4_beats_symmetric_int4_on_normal_weights_at_the_same_block_size():
    w = randn(128, 256)
    nf4 = rel_err(quantize_nf4(w, 64).dequantize(), w)
    int4 = rel_err(quantize_int4(w, 64, symmetric=True).dequantize(), w)
    assert nf4 < int4


def test_double_quant_shrinks_scales_and_keeps_the_error():
    w = randn(256, 512)
    plain, dq = quantize_nf4(w, 64), quantize_nf4(w, 64, double_quant=True)
    assert dq.absmax.dtype == torch.int8
    assert (plain.absmax.nbytes - (dq.nbytes - dq.packed.nbytes)) / plain.absmax.nbytes > 0.7
    assert rel_err(dq.scales(), plain.absmax) < 0.01
    assert abs(rel_err(dq.dequantize(), w) - rel_err(plain.dequantize(), w)) < 1e-3


def _bnb():
    bnb = pytest.importorskip("bitsandbytes")
    # bitsandbytes 0.50 prints a notice about an optional CPU kernel package at import.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes.functional as bnb_functional
    return bnb, bnb_functional


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nf4_reproduces_bitsandbytes_dequantized_weights(dtype):
    _, bf = _bnb()
    w = randn(256, 192, seed=3).to(dtype)
    try:
        q, state = bf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
        theirs = bf.dequantize_4bit(q, state).float()
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"bitsandbytes' CPU backend cannot quantize_4bit {dtype}: {err}")
    ours = quantize_nf4(w, 64).dequantize()
    assert torch.allclose(state.code.float().cpu(), NF4_CODE)
    # ours in fp32, theirs in w's dtype: equal to within that dtype's rounding
    tol = 0 if dtype == torch.float32 else 2**-11
    assert ((ours - theirs).abs() <= tol * ours.abs() + 1e-7).all()


# ---------------------------------------------------------------------------- QuantLinear


@pytest.mark.parametrize(
    "scheme", ["int8", "int8-asym", "int8-tensor", "int4-g32", "int4sym-g64", "nf4-g64-dq"]
)
def test_quantlinear_equals_linear_with_its_dequantized_weight(scheme):
    lin = nn.Linear(128, 40)
    ql = QuantLinear(lin, scheme)
    x = randn(3, 5, 128, seed=1)
    ref = nn.functional.linear(x, ql.dequantized_weight(), lin.bias)
    assert torch.allclose(ql(x), ref, atol=1e-6)
    assert rel_err(ql(x), lin(x)) < (0.02 if scheme.startswith("int8") else 0.15)


def test_weight_bytes_near_ideal_ratios():
    lin = nn.Linear(1024, 256, bias=False)
    fp32 = lin.weight.nbytes
    assert fp32 / QuantLinear(lin, "int8").weight_nbytes > 4 * 0.95
    assert fp32 / QuantLinear(lin, "int4sym-g128").weight_nbytes > 7.0
    assert fp32 / QuantLinear(lin, "nf4-g64-dq").weight_nbytes > 7.5


def test_unknown_scheme_lists_the_valid_ones():
    with pytest.raises(ValueError, match="int4-g<G>"):
        quant.parse_scheme("int3")
    with pytest.raises(ValueError, match="unknown"):
        quant.parse_scheme("int4-g64-dq")


def test_fake_quant_activations_keeps_outlier_columns():
    x = randn(4, 10, 64) * 0.1
    x[..., 5] = 40.0  # one outlier feature, as in LLM.int8()
    tensor = quant.fake_quant_activations(x, "tensor")
    mixed = quant.fake_quant_activations(x, "tensor", outlier_threshold=6.0)
    assert torch.equal(mixed[..., 5], x[..., 5])
    others = [i for i in range(64) if i != 5]
    assert (
        rel_err(mixed[..., others], x[..., others])
        < rel_err(tensor[..., others], x[..., others]) / 10
    )


def test_asymmetric_token_activations_use_the_whole_grid_on_one_sided_rows():
    """A zero point per token puts a one-sided row (SiLU-gated, mostly >= 0) on all 256
    levels: half the step of the symmetric grid, so about half its error; a row already
    on an affine grid of 256 levels comes back exactly."""
    x = torch.nn.functional.silu(randn(8, 16, 96) * 3)
    sym = quant.fake_quant_activations(x, "token")
    asym = quant.fake_quant_activations(x, "token-asym")
    assert rel_err(asym, x) < 0.7 * rel_err(sym, x)
    grid = -0.3 + 0.01 * torch.randint(0, 256, (4, 64)).float()
    grid[:, 0], grid[:, 1] = -0.3, -0.3 + 2.55  # every row spans the full 256 levels
    assert torch.allclose(quant.fake_quant_activations(grid, "token-asym"), grid, atol=1e-6)
    with pytest.raises(ValueError, match="token-asym"):
        quant.fake_quant_activations(x, "channel")
    with pytest.raises(ValueError, match="granularity"):
        quant.set_activation_quant(torch.nn.Linear(2, 2), "per-token")


# ------------------------------------------------------------------------ bundled model


@pytest.fixture(scope="module")
def held_out():
    return held_out_ids(load_tokenizer())


def test_quantize_model_swaps_all_linears_but_the_kept_head(model):
    qm = quantize_model(load_model(), "int4-g64")
    names = quant.linear_names(qm)
    swapped = [n for n in names if isinstance(qm.get_submodule(n), QuantLinear)]
    assert len(swapped) == 7 * model.config.num_hidden_layers
    assert isinstance(qm.lm_head, nn.Linear) and qm.lm_head.weight is qm.model.embed_tokens.weight
    with pytest.raises(ValueError, match="names no linear"):
        quantize_model(load_model(), "int8", keep=["lm_heads"])


def test_int8_model_perplexity_within_one_percent_and_int4_agrees(model, held_out):
    kw = {"window": 256, "max_windows": 16}
    base = perplexity(model, held_out, **kw)
    int8 = quantize_model(load_model(), "int8")
    assert abs(perplexity(int8, held_out, **kw) / base - 1) < 0.01
    nf4 = quantize_model(load_model(), "nf4-g64")
    assert next_token_agreement(model, nf4, held_out, **kw) > 0.85
    assert perplexity(nf4, held_out, **kw) / base - 1 < 0.10


def test_activation_absmax_sees_every_linear_input(model, held_out):
    stats = quant.activation_absmax(model, held_out[:128][None])
    assert set(stats) == set(quant.linear_names(model))
    assert all(v.shape == (model.get_submodule(k).in_features,) for k, v in stats.items())


def test_keep_nothing_quantizes_the_tied_head_as_its_own_copy():
    qm = quantize_model(load_model(), "nf4-g64", keep=())
    assert isinstance(qm.lm_head, QuantLinear)
    emb = qm.model.embed_tokens.weight
    assert emb.dtype == torch.float32  # the lookup table stays full precision
    assert rel_err(qm.lm_head.dequantized_weight(), emb) < 0.15
    assert {"packed", "absmax"} <= dict(qm.lm_head.named_buffers()).keys()  # moves with .to()
