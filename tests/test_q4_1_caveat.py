"""Chapter 06's caveat, tested: SmolLM2's published weights went through Q4_1, so Q4_1's own
grid reproduces them exactly, while an INT4 g32 format with an integer zero point does not
(`python -m benchmarks.quant --q4-1` measures what that costs in perplexity)."""

import torch
from torch import nn

from minillm.bench.q4_1 import requantized, requantized_weight


def q4_1_grid(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 file holds them: per block of 32, m + q d with fp16 m and d, codes
    0..15 with both ends used (the block's min and max define d)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(rows, cols // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-(torch.rand(rows, cols // 32, 1, generator=g) * 8 + 3.3) * d).half().float()
    return (m + q * d).reshape(rows, cols)


def test_q4_1_grid_is_a_fixed_point_of_q4_1_but_not_of_int4_with_an_integer_zero():
    w = q4_1_grid(64, 128)
    assert torch.equal(requantized_weight(w, "q4_1-g32"), w)
    int4 = requantized_weight(w, "int4-g32")
    assert (int4 == w).float().mean() < 0.5  # each block shifted by its zero point's rounding
    step = (w.reshape(64, 4, 32).amax(-1) - w.reshape(64, 4, 32).amin(-1)) / 15
    err = (int4 - w).abs().reshape(64, 4, 32).amax(-1)
    assert (err <= step / 2 + 1e-6).all()  # by at most half a step, as the rounding allows


def test_smollm2_linear_weights_sit_on_q4_1_grid(smollm2):
    small = nn.Module()  # two of SmolLM2's layers: enough to check, cheap to copy
    small.q = smollm2.model.layers[0].self_attn.q_proj
    small.down = smollm2.model.layers[29].mlp.down_proj
    again = requantized(small, "q4_1-g32")
    assert torch.equal(again.q.weight, small.q.weight)
    assert torch.equal(again.down.weight, small.down.weight)
    assert not torch.equal(requantized(small, "int4-g32").q.weight, small.q.weight)
