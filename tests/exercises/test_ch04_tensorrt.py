"""Chapter 04 exercises, graded on known distributions and on the bundled model.

`ch04` is the module under test: `solutions.ch04_tensorrt` by default,
`exercises.ch04_tensorrt` with MINILLM_IMPL=exercises (see conftest.py). Every test name
starts with `test_ch04_<exercise>`, so `-k "ch04 and percentile"` grades one exercise.
"""

from __future__ import annotations

import pytest
import torch

from minillm import load_model, load_tokenizer
from minillm.quant.calibrate import calibration_batches, fake_quantize_model, histogram_stats
from minillm.training import held_out_ids, next_token_agreement, perplexity

OUTLIERS = torch.tensor([40.0, -35.0, 30.0, 25.0, -50.0])


def gaussian_with_outliers(n: int = 200_000) -> torch.Tensor:
    return torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(0)), OUTLIERS])


# --------------------------------------------------------------- fake_quantize_int8


def test_ch04_fake_quantize_int8_error_bound_and_saturation(ch04):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 3
    scale = 4.0 / 127
    y = ch04.fake_quantize_int8(x, scale)
    assert y.shape == x.shape and y.dtype == x.dtype
    inside = x.abs() <= 4.0
    err = (y - x)[inside].abs().max().item()
    assert err <= scale / 2 + 1e-6, f"error {err:.4g} inside the range exceeds scale/2"
    assert torch.allclose(y[~inside].abs(), torch.full_like(y[~inside], 4.0)), (
        "values beyond 127 * scale must saturate to +-127 * scale"
    )
    assert torch.equal(ch04.fake_quantize_int8(y, scale), y), "grid values must be fixed points"
    assert (y / scale).round().abs().max() <= 127


def test_ch04_fake_quantize_int8_per_channel_scale(ch04):
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    y = ch04.fake_quantize_int8(w, scale)
    assert ((y - w).abs() <= scale / 2 + 1e-6).all(), "a [rows, 1] scale applies per row"


# ----------------------------------------------------------------- percentile_scale


def test_ch04_percentile_scale_clips_the_outliers(ch04):
    x = gaussian_with_outliers()
    t = ch04.percentile_scale(x, 99.99) * 127
    assert isinstance(ch04.percentile_scale(x), float)
    # |N(0,1)|'s 99.99th percentile is 3.89 (with 200k samples: within a few hundredths).
    assert 3.8 < t < 4.0, f"threshold {t:.3f}: expected the 99.99th percentile of |x| (~3.89)"
    assert ch04.percentile_scale(x, 100.0) * 127 == pytest.approx(50.0), "100% is the max"
    # The quality the percentile buys: much lower error on the bulk of the values.
    bulk = x[:-5]
    mse = {
        "max": (ch04.fake_quantize_int8(bulk, 50.0 / 127) - bulk).pow(2).mean(),
        "percentile": (ch04.fake_quantize_int8(bulk, t / 127) - bulk).pow(2).mean(),
    }
    assert mse["percentile"] < mse["max"] / 20


def test_ch04_percentile_scale_edge_cases(ch04):
    assert ch04.percentile_scale(torch.zeros(100)) > 0, "zeros must not give a zero scale"
    x = torch.arange(1, 1001, dtype=torch.float32)
    assert ch04.percentile_scale(x, 50.0) * 127 == pytest.approx(500.0, abs=1.0)
    for bad in (0.0, 101.0):
        with pytest.raises(ValueError):
            ch04.percentile_scale(x, bad)


# ---------------------------------------------------------------------- kl_threshold


def test_ch04_kl_threshold_clips_a_long_tail(ch04):
    s = histogram_stats(gaussian_with_outliers(), bins=2048)
    t = ch04.kl_threshold(s.hist, s.bin_width)
    assert 3.0 < t < 25.0, f"threshold {t:.3f}: KL should keep the gaussian, drop the outliers"
    edges = t / s.bin_width
    assert edges == pytest.approx(round(edges)), "return a bin edge: best_i * bin_width"


def test_ch04_kl_threshold_keeps_a_distribution_without_tail(ch04):
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(3)) * 2 - 1
    s = histogram_stats(x, bins=1024)
    assert ch04.kl_threshold(s.hist, s.bin_width) > 0.9 * s.absmax


def test_ch04_kl_threshold_cannot_go_below_levels_bins(ch04):
    # One huge outlier: every candidate from `levels` bins up is allowed, none below.
    x = torch.cat([torch.randn(100_000, generator=torch.Generator().manual_seed(4)), OUTLIERS * 20])
    s = histogram_stats(x, bins=1024)
    t = ch04.kl_threshold(s.hist, s.bin_width)
    assert t >= 128 * s.bin_width - 1e-9
    with pytest.raises(ValueError):
        ch04.kl_threshold(torch.ones(64, dtype=torch.float64), 0.1)


# ----------------------------------------------------------- calibrate_linear_inputs


@pytest.fixture(scope="module")
def bundled():
    tok = load_tokenizer()
    return load_model(), calibration_batches(tok, 2, 2, 64), held_out_ids(tok)


def test_ch04_calibrate_linear_inputs_covers_every_linear(ch04, bundled):
    model, batches, _ = bundled
    scales = ch04.calibrate_linear_inputs(model, batches)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(scales) == sorted(linears)
    assert not any(m._forward_pre_hooks for m in model.modules()), "remove your hooks"
    # Check one by hand: layer 0's q_proj reads the first norm of the embeddings.
    layer0 = model.model.layers[0]
    with torch.inference_mode():
        x = torch.cat(
            [layer0.input_layernorm(model.model.embed_tokens(b)).flatten() for b in batches]
        )
    k = int(torch.tensor(0.9999 * x.numel()).ceil())
    expected = x.abs().kthvalue(k).values.item() / 127
    assert scales["model.layers.0.self_attn.q_proj"] == pytest.approx(expected, rel=0.02)


def test_ch04_calibrate_linear_inputs_quality(ch04, bundled):
    model, batches, ids = bundled
    scales = ch04.calibrate_linear_inputs(model, batches)
    kw = {"window": 128, "max_windows": 4}
    base = perplexity(model, ids, **kw)
    q = fake_quantize_model(model, scales)
    ppl = perplexity(q, ids, **kw)
    agree = next_token_agreement(model, q, ids, **kw)
    assert ppl < base * 1.05, f"int8 perplexity {ppl:.2f} vs fp32 {base:.2f}: more than 5% worse"
    assert agree > 0.9, f"only {agree:.1%} of next-token predictions unchanged"


# ------------------------------------------------------------------- qdq_linear_onnx


def run_onnx(proto, x: torch.Tensor) -> torch.Tensor:
    """The graph as ONNX defines it (`qdq_session`: on a CPU whose fused int8 GEMM would
    saturate, ORT runs the Q/DQ pairs as written instead)."""
    pytest.importorskip("onnxruntime")
    from minillm.export.onnx_runtime import qdq_session

    session = qdq_session(proto.SerializeToString())
    return torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


def int8_linear(x: torch.Tensor, w: torch.Tensor, x_scale: float) -> torch.Tensor:
    """The reference: int8 quantize-dequantize of x (per tensor, ONNX's [-128, 127]) and of
    w (per output channel, absmax / 127), then an fp32 matmul."""
    s = torch.tensor(x_scale, dtype=torch.float32)
    xq = torch.clamp(torch.round(x / s), -128, 127) * s
    w_scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return xq @ (torch.round(w / w_scale) * w_scale).T


def test_ch04_qdq_linear_onnx_is_a_qdq_graph_with_any_batch(ch04):
    onnx = pytest.importorskip("onnx")
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(5))
    proto = ch04.qdq_linear_onnx(w, 0.02)
    onnx.checker.check_model(proto)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 2, (
        f"one Q -> DQ pair on the input and one on the weight, got {ops}"
    )
    for batch in (1, 7):
        y = run_onnx(proto, torch.randn(batch, 40))
        assert y.shape == (batch, 24), f"batch {batch}: y is {tuple(y.shape)}, not ({batch}, 24)"


def test_ch04_qdq_linear_onnx_equals_int8_fake_quantization(ch04):
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)
    x_scale = float(x.abs().max()) / 127  # no clipping: the whole range is on the grid
    got = run_onnx(ch04.qdq_linear_onnx(w, x_scale), x)
    ref = int8_linear(x, w, x_scale)
    err = (got - ref).abs().max().item()
    assert err < 1e-4, (
        f"max |ONNX - int8 fake quantization| = {err:.3g}: check the scales (x: input_scale; "
        "w: max |w| per output channel / 127) and the zero points (int8 zeros)"
    )
    assert (got - x @ w.T).abs().max() > 1e-3, "the output is the fp32 linear: quantize it"


def test_ch04_qdq_linear_onnx_scales_the_weight_per_output_channel(ch04):
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(8, 32, generator=g), torch.randn(4, 32, generator=g)
    w[0] *= 1000  # one loud channel: a per-tensor weight scale would flatten the others
    x_scale = float(x.abs().max()) / 127
    got = run_onnx(ch04.qdq_linear_onnx(w, x_scale), x)
    quiet = (got - x @ w.T)[:, 1:].abs().max().item()
    assert quiet < 1.0, (  # per channel: ~0.1 here; one scale for all: ~5
        f"error {quiet:.3g} on the quiet channels: one scale per output channel (axis 1 "
        "of the [in, out] weight), max |w| of the channel / 127"
    )
    assert torch.allclose(got, int8_linear(x, w, x_scale), atol=1e-3, rtol=1e-4)
