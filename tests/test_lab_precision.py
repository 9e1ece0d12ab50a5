"""minillm.lab.precision: input peaks through hooks, top-1 agreement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minillm.lab.precision import FP16_MAX, FP16_SQUARE_LIMIT, input_peaks, top1_agreement


def test_input_peaks_sees_each_modules_input_and_removes_its_hooks():
    a, b = nn.Identity(), nn.Identity()

    def run():
        a(torch.tensor([1.0, -300.0]))
        b(torch.tensor([2.0]))
        a(torch.tensor([5.0]))  # a second call keeps the max

    assert input_peaks([a, b], run) == [300.0, 2.0]
    assert not a._forward_pre_hooks and not b._forward_pre_hooks


def test_fp16_square_limit_is_where_squares_overflow():
    assert FP16_MAX == 65504
    just_below = torch.tensor(FP16_SQUARE_LIMIT - 1, dtype=torch.float16)
    assert torch.isfinite(just_below**2)
    assert torch.isinf(torch.tensor(FP16_SQUARE_LIMIT + 1, dtype=torch.float16) ** 2)


def test_top1_agreement():
    ref = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 2.0]])
    assert top1_agreement(ref, ref) == 1.0
    assert top1_agreement(ref.flip(-1), ref) == 0.0
    with pytest.raises(ValueError):
        top1_agreement(ref, ref[:2])


def test_tensor_traffic_counts_each_ops_inputs_and_outputs():
    from minillm.lab import tensor_traffic

    x = torch.ones(1000)
    assert tensor_traffic(lambda: x + x) == 3 * x.nbytes  # two reads, one write
    assert tensor_traffic(lambda: x.view(10, 100)) == 0  # a view moves nothing
    assert tensor_traffic(lambda: (x * 2) * 3) == 4 * x.nbytes  # unfused: the intermediate twice
