"""Chapter 06 exercises, graded against minillm.quant's INT4 format.

`ch06` is the module under test: `solutions.ch06_quantization` by default,
`exercises.ch06_quantization` with MINILLM_IMPL=exercises (see conftest.py). Every test
name starts with `test_ch06_<exercise>`, so `-k "ch06 and pack"` selects one exercise.
"""

from __future__ import annotations

import pytest
import torch

from minillm.quant import Int4Weight
from minillm.quant.formats import pack_int4, unpack_int4


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
