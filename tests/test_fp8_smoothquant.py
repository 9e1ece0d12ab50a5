"""FP8 (minillm.quant.fp8) and SmoothQuant W8A8 (minillm.quant.smoothquant)."""

from __future__ import annotations

import copy

import pytest
import torch

from minillm.quant import quantize_model, set_activation_quant, weight_bytes
from minillm.quant.fp8 import (
    fp8_dequantize,
    fp8_fake_quant,
    fp8_quantize,
    fp8_quantize_model,
    scaled_mm,
    time_scaled_mm,
)
from minillm.quant.smoothquant import (
    calibration_absmax,
    outlier_report,
    search_smooth_model,
    smooth_model,
    smoothing_scales,
    smoothquant_model,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_formats_trade_precision_for_range() -> None:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    e4m3 = _rel(fp8_dequantize(*fp8_quantize(x, "e4m3", per_row=True)), x)
    e5m2 = _rel(fp8_dequantize(*fp8_quantize(x, "e5m2", per_row=True)), x)
    # 3 vs 2 mantissa bits: relative step 2^-4 vs 2^-3, about half the error
    assert e4m3 < 0.04 and e5m2 < 0.08 and e4m3 < 0.6 * e5m2, (e4m3, e5m2)
    codes, scale = fp8_quantize(x, "e4m3")
    assert codes.dtype == torch.float8_e4m3fn and codes.float().abs().max() == 448
    with pytest.raises(ValueError, match="e4m3, e5m2"):
        fp8_quantize(x, "e3m4")


def test_scaled_mm_equals_dequantize_then_matmul() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)
    codes, w_scale = fp8_quantize(w, "e4m3")
    ref = fp8_fake_quant(x, "e4m3") @ fp8_dequantize(codes, w_scale).T
    assert _rel(scaled_mm(x, codes, w_scale), ref) < 1e-5


def test_time_scaled_mm_says_what_it_skipped() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark times it instead")
    assert "no CUDA device" in time_scaled_mm()["skipped"]


def test_fp8_model_is_close_and_a_quarter_of_the_bytes(model) -> None:
    ids = torch.tensor([[1, 17, 99, 4, 250, 31, 7, 8]])
    q = fp8_quantize_model(copy.deepcopy(model), act_fmt="e4m3", act_per_token=True)
    with torch.inference_mode():
        ref, out = model(ids), q(ids)
    assert _rel(out, ref) < 0.1
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    head = model.lm_head.weight.nbytes  # kept in fp32 by both
    fp8 = weight_bytes(q, only_linear=True) - head
    assert fp8 < 0.26 * (weight_bytes(model, only_linear=True) - head)


def test_smoothing_scales_follow_the_formula() -> None:
    act, w = torch.tensor([8.0, 1.0]), torch.tensor([[0.5, 2.0], [-1.0, 1.0]])
    s = smoothing_scales(act, w, alpha=0.5)
    assert torch.allclose(s, torch.tensor([8**0.5 / 1.0, 1.0 / 2**0.5]))
    with pytest.raises(ValueError, match="alpha"):
        smoothing_scales(act, w, 1.5)


def _outlier_model(model):
    """The bundled model with one hidden channel blown up 30x in every norm's output and
    undone in the linears reading it: the same function, LLM-style activation outliers."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for block in m.model.layers:
            for norm, lins in (
                (
                    block.input_layernorm,
                    (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj),
                ),
                (block.post_attention_layernorm, (block.mlp.gate_proj, block.mlp.up_proj)),
            ):
                norm.weight[5] *= 30.0
                for lin in lins:
                    lin.weight[:, 5] /= 30.0
    return m


def test_smoothquant_undoes_activation_outliers(model) -> None:
    m = _outlier_model(model)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, model.config.vocab_size, (2, 64), generator=g)]
    ids = torch.randint(1, model.config.vocab_size, (2, 64), generator=g)
    q_proj = outlier_report(calibration_absmax(m, batches))[0]
    assert q_proj.top_channels[0] == 5 and q_proj.ratio > 10
    smoothed = copy.deepcopy(m)
    smooth_model(smoothed, batches, alpha=0.5)
    with torch.inference_mode():
        ref = m(ids)
        assert torch.allclose(smoothed(ids), ref, atol=1e-4, rtol=1e-4)  # folding alone
    assert outlier_report(calibration_absmax(smoothed, batches))[0].ratio < q_proj.ratio / 3
    plain = quantize_model(copy.deepcopy(m), "int8")
    set_activation_quant(plain, "tensor")
    sq = smoothquant_model(copy.deepcopy(m), batches, alpha=0.5, act="tensor")
    with torch.inference_mode():
        err_plain, err_sq = _rel(plain(ids), ref), _rel(sq(ids), ref)
    assert err_sq < 0.5 * err_plain, (err_sq, err_plain)


def test_smoothquant_alpha_search_fits_each_layer(model) -> None:
    """Per-group alphas, searched on the W8A8 output error of the module each group feeds:
    on the outlier model the searched W8A8 model is at least as close to float as the
    fixed alpha 0.5 (on held-out ids); `keep` leaves a named layer unquantized."""
    m = _outlier_model(model)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, model.config.vocab_size, (2, 64), generator=g)]
    ids = torch.randint(1, model.config.vocab_size, (2, 64), generator=g)
    searched = copy.deepcopy(m)
    chosen = search_smooth_model(searched, batches, alphas=(0.3, 0.5, 0.8))
    assert set(chosen.values()) <= {0.3, 0.5, 0.8}
    assert len(chosen) == 3 * model.config.num_hidden_layers  # GQA: no v -> o group
    with torch.inference_mode():
        ref = m(ids)
        assert torch.allclose(searched(ids), ref, atol=1e-4, rtol=1e-4)  # folding alone
    fixed = smoothquant_model(copy.deepcopy(m), batches, alpha=0.5)
    best = smoothquant_model(copy.deepcopy(m), batches, alpha=(0.3, 0.5, 0.8))
    with torch.inference_mode():
        err_fixed, err_best = _rel(fixed(ids), ref), _rel(best(ids), ref)
    assert err_best <= 1.05 * err_fixed, (err_best, err_fixed)
    kept = smoothquant_model(copy.deepcopy(m), batches, 0.5, keep=("lm_head", "1.mlp.down_proj"))
    assert type(kept.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert type(kept.model.layers[0].mlp.down_proj) is not torch.nn.Linear
    with pytest.raises(ValueError, match="at least one alpha"):
        search_smooth_model(copy.deepcopy(m), batches, alphas=())
