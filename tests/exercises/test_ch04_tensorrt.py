"""Chapter 04 exercises, graded on known distributions and on the bundled model.

`ch04` is the module under test: `solutions.ch04_tensorrt` by default,
`exercises.ch04_tensorrt` with MINILLM_IMPL=exercises (see conftest.py). Every test name
starts with `test_ch04_<exercise>`, so `-k "ch04 and percentile"` grades one exercise.
"""

from __future__ import annotations

import pytest
import torch

from exercises.feedback import worst
from minillm import load_model, load_tokenizer
from minillm.quant.calibrate import calibration_batches, fake_quantize_model, histogram_stats
from minillm.training import held_out_ids, next_token_agreement, perplexity

OUTLIERS = torch.tensor([40.0, -35.0, 30.0, 25.0, -50.0])


def gaussian_with_outliers(n: int = 200_000) -> torch.Tensor:
    return torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(0)), OUTLIERS])


def bad_rows(y: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> list[int]:
    return ((y - w).abs() > scale / 2 + 1e-6).any(dim=1).nonzero().flatten().tolist()


def num(x) -> str:
    """A number the learner's code returned, for a message (whatever its type)."""
    try:
        return f"{float(x):.6g}"
    except (TypeError, ValueError, RuntimeError):
        return repr(x)


# --------------------------------------------------------------- fake_quantize_int8


def test_ch04_fake_quantize_int8_error_bound_and_saturation(ch04):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 3
    scale = 4.0 / 127
    y = ch04.fake_quantize_int8(x, scale)
    case = "fake_quantize_int8(x [10000] of std 3, scale = 4 / 127)"
    assert y.shape == x.shape, (
        f"{case}: expected shape {tuple(x.shape)}, got {tuple(y.shape)}; hint: it is "
        "elementwise: round(x / scale), clamp, times scale"
    )
    assert y.dtype == x.dtype, (
        f"{case}: expected dtype {x.dtype}, got {y.dtype}; hint: return the dequantized "
        "floats (codes times scale), not the int8 codes"
    )
    inside = x.abs() <= 4.0
    err = (y - x)[inside].abs().max().item()
    assert err <= scale / 2 + 1e-6, (
        f"{case}: expected |y - x| <= scale / 2 = {scale / 2:.4g} inside [-4, 4], got "
        f"{err:.4g}; hint: round to the nearest level (torch.round), not floor or truncation"
    )
    beyond = y[~inside].abs()
    assert torch.allclose(beyond, torch.full_like(y[~inside], 4.0)), (
        f"{case}: expected the values beyond 127 * scale = 4.0 to saturate to +-4.0, got |y| "
        f"from {beyond.min():.4g} to {beyond.max():.4g} there; hint: clamp the codes to "
        "[-127, 127] before multiplying back by scale"
    )
    again = ch04.fake_quantize_int8(y, scale)
    assert torch.equal(again, y), (
        f"fake_quantize_int8(its own output, the same scale): expected it unchanged (grid "
        f"values are fixed points): {worst(again, y)}; hint: y = clamp(round(x / scale), "
        "-127, 127) * scale, with no offset"
    )
    codes = (y / scale).round().abs().max()
    assert codes <= 127, (
        f"{case}: expected codes y / scale within [-127, 127], got |code| up to {codes:.4g}; "
        "hint: symmetric int8 clamps to -127..127"
    )


def test_ch04_fake_quantize_int8_per_channel_scale(ch04):
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    y = ch04.fake_quantize_int8(w, scale)
    assert ((y - w).abs() <= scale / 2 + 1e-6).all(), (
        f"fake_quantize_int8(w [4, 16], scale [4, 1], one per row): expected |y - w| <= its "
        f"row's scale / 2, got larger errors in rows {bad_rows(y, w, scale)}; hint: "
        "let the [rows, 1] scale broadcast; do not reduce it to one number"
    )


# ----------------------------------------------------------------- percentile_scale


def test_ch04_percentile_scale_clips_the_outliers(ch04):
    x = gaussian_with_outliers()
    t = ch04.percentile_scale(x, 99.99) * 127
    case = "percentile_scale(200k N(0, 1) samples and 5 outliers up to |50|"
    default = ch04.percentile_scale(x)
    assert isinstance(default, float), (
        f"{case}): expected a Python float, got {type(default).__name__} {default!r:.80}; "
        "hint: return float(threshold) / 127, not a tensor"
    )
    # |N(0,1)|'s 99.99th percentile is 3.89 (with 200k samples: within a few hundredths).
    assert 3.8 < t < 4.0, (
        f"{case}, 99.99) * 127: expected the 99.99th percentile of |x|, about 3.89, got "
        f"{num(t)}; hint: the k-th smallest |x| (kthvalue) with k = ceil(percentile / 100 * n), "
        "of |x| (abs first), divided by 127"
    )
    top = ch04.percentile_scale(x, 100.0) * 127
    assert top == pytest.approx(50.0), (
        f"{case}, 100.0) * 127: expected max |x| = 50.0, got {num(top)}; hint: the 100th "
        "percentile is the largest |x|: k = n"
    )
    # The quality the percentile buys: much lower error on the bulk of the values.
    bulk = x[:-5]
    mse = {
        "max": (ch04.fake_quantize_int8(bulk, 50.0 / 127) - bulk).pow(2).mean(),
        "percentile": (ch04.fake_quantize_int8(bulk, t / 127) - bulk).pow(2).mean(),
    }
    assert mse["percentile"] < mse["max"] / 20, (
        f"fake_quantize_int8 of the Gaussian bulk at your percentile threshold {num(t)}: "
        f"expected a mean squared error under 1/20 of the max threshold's "
        f"({num(mse['max'])}), got {num(mse['percentile'])}; hint: a threshold near 3.9 "
        "instead of 50 makes 13x finer steps: check percentile_scale and the rounding"
    )


def test_ch04_percentile_scale_edge_cases(ch04):
    zero = ch04.percentile_scale(torch.zeros(100))
    assert zero > 0, (
        f"percentile_scale(zeros(100)): expected a scale > 0, got {num(zero)}; hint: floor the "
        "threshold at a tiny positive number (1e-12), so that x / scale stays finite"
    )
    x = torch.arange(1, 1001, dtype=torch.float32)
    half = ch04.percentile_scale(x, 50.0) * 127
    assert half == pytest.approx(500.0, abs=1.0), (
        f"percentile_scale(1, 2, ..., 1000, 50.0) * 127: expected 500 (+-1), got {num(half)}; "
        "hint: the k-th smallest |x| with k = ceil(percentile / 100 * n); percentile is in "
        "0..100, not 0..1"
    )
    for bad in (0.0, 101.0):
        with pytest.raises(ValueError):
            ch04.percentile_scale(x, bad)


# ---------------------------------------------------------------------- kl_threshold


def test_ch04_kl_threshold_clips_a_long_tail(ch04):
    s = histogram_stats(gaussian_with_outliers(), bins=2048)
    t = ch04.kl_threshold(s.hist, s.bin_width)
    case = "kl_threshold(histogram of 200k N(0, 1) samples and 5 outliers up to 50, 2048 bins)"
    assert 3.0 < t < 25.0, (
        f"{case}: expected a threshold between 3 and 25 (keep the Gaussian, drop the "
        f"outliers), got {num(t)}; hint: for each i >= 128 bins fold the clipped tail into "
        "bin i - 1, merge the i bins into 128 levels, and keep the i of least KL(P || Q)"
    )
    edges = t / s.bin_width
    assert edges == pytest.approx(round(edges)), (
        f"{case}: expected a bin edge (a whole number of bin widths), got {num(t)} = "
        f"{num(edges)} bin widths; hint: return best_i * bin_width"
    )


def test_ch04_kl_threshold_keeps_a_distribution_without_tail(ch04):
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(3)) * 2 - 1
    s = histogram_stats(x, bins=1024)
    t = ch04.kl_threshold(s.hist, s.bin_width)
    assert t > 0.9 * s.absmax, (
        f"kl_threshold(histogram of uniform(-1, 1), 1024 bins): expected more than 0.9 x "
        f"max |x| = {0.9 * s.absmax:.4g} (no tail to clip), got {num(t)}; hint: normalise P "
        "and Q over the kept bins, and spread each level's count over its nonzero bins only"
    )


def test_ch04_kl_threshold_cannot_go_below_levels_bins(ch04):
    # One huge outlier: every candidate from `levels` bins up is allowed, none below.
    x = torch.cat([torch.randn(100_000, generator=torch.Generator().manual_seed(4)), OUTLIERS * 20])
    s = histogram_stats(x, bins=1024)
    t = ch04.kl_threshold(s.hist, s.bin_width)
    assert t >= 128 * s.bin_width - 1e-9, (
        f"kl_threshold(N(0, 1) and outliers up to 1000, 1024 bins, levels=128): expected at "
        f"least 128 bins = {128 * s.bin_width:.4g}, got {num(t)}; hint: the candidates start "
        "at i = levels bins: fewer bins than int8 levels cannot be merged into them"
    )
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
    case = "calibrate_linear_inputs(the bundled model, 2 batches)"
    assert sorted(scales) == sorted(linears), (
        f"{case}: expected one scale for each of the {len(linears)} nn.Linear modules, got "
        f"{len(scales)} keys; missing {sorted(set(linears) - set(scales))[:3]}, extra "
        f"{sorted(set(scales) - set(linears))[:3]}; hint: key by the names "
        "model.named_modules() gives, for every nn.Linear"
    )
    hooked = [n for n, m in model.named_modules() if m._forward_pre_hooks]
    assert not any(m._forward_pre_hooks for m in model.modules()), (
        f"{case}: expected no hooks left on the model, got forward pre-hooks on {hooked[:3]}; "
        "hint: keep the handles that register_forward_pre_hook returns and .remove() each"
    )
    # Check one by hand: layer 0's q_proj reads the first norm of the embeddings.
    layer0 = model.model.layers[0]
    with torch.inference_mode():
        x = torch.cat(
            [layer0.input_layernorm(model.model.embed_tokens(b)).flatten() for b in batches]
        )
    k = int(torch.tensor(0.9999 * x.numel()).ceil())
    expected = x.abs().kthvalue(k).values.item() / 127
    got = scales["model.layers.0.self_attn.q_proj"]
    assert got == pytest.approx(expected, rel=0.02), (
        f"{case}: layer 0's q_proj: expected scale {expected:.6g} (the 99.99th percentile of "
        f"|input| over both batches / 127), got {num(got)}; hint: a pre-hook sees the input "
        "(args[0]); pool every batch's inputs of a layer before taking the percentile"
    )


def test_ch04_calibrate_linear_inputs_quality(ch04, bundled):
    model, batches, ids = bundled
    scales = ch04.calibrate_linear_inputs(model, batches)
    kw = {"window": 128, "max_windows": 4}
    base = perplexity(model, ids, **kw)
    q = fake_quantize_model(model, scales)
    ppl = perplexity(q, ids, **kw)
    agree = next_token_agreement(model, q, ids, **kw)
    case = "the bundled model fake-quantized to int8 with calibrate_linear_inputs' scales"
    hint = (
        "one scale per Linear from its own inputs, 99.99th percentile of |x| / 127: a scale "
        "too small clips the bulk, one too large rounds it coarsely"
    )
    assert ppl < base * 1.05, (
        f"{case}: expected a perplexity under 1.05 x fp32's {base:.2f} = {1.05 * base:.2f}, "
        f"got {ppl:.2f}; hint: {hint}"
    )
    assert agree > 0.9, (
        f"{case}: expected over 90% of next-token predictions unchanged, got {agree:.1%}; "
        f"hint: {hint}"
    )


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
        f"qdq_linear_onnx(w [24, 40], 0.02): expected 2 QuantizeLinear and 2 DequantizeLinear "
        f"nodes, got the nodes {ops}; hint: one Q -> DQ pair on the input and one on the "
        "weight, then the MatMul"
    )
    for batch in (1, 7):
        y = run_onnx(proto, torch.randn(batch, 40))
        assert y.shape == (batch, 24), (
            f"qdq_linear_onnx(w [24, 40], 0.02) in ORT on x [{batch}, 40]: expected y of shape "
            f"({batch}, 24), got {tuple(y.shape)}; hint: declare x as ['batch', in] (a named, "
            "symbolic first dim) and y as ['batch', out]"
        )


def test_ch04_qdq_linear_onnx_equals_int8_fake_quantization(ch04):
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)
    x_scale = float(x.abs().max()) / 127  # no clipping: the whole range is on the grid
    got = run_onnx(ch04.qdq_linear_onnx(w, x_scale), x)
    ref = int8_linear(x, w, x_scale)
    err = (got - ref).abs().max().item()
    case = "qdq_linear_onnx(w [32, 64], x_scale = max |x| / 127) in ORT on x [16, 64]"
    assert err < 1e-4, (
        f"{case}: expected the int8 fake-quantized linear (max |diff| < 1e-4), got max |diff| "
        f"{err:.3g}; hint: check the scales (x: input_scale; w: max |w| per output channel / "
        "127) and the zero points (int8 zeros)"
    )
    fp32 = (got - x @ w.T).abs().max()
    assert fp32 > 1e-3, (
        f"{case}: expected a result that differs from the fp32 linear x @ w.T, got max |diff| "
        f"{fp32:.3g}; hint: the output is the fp32 linear: put the Q/DQ pairs on the MatMul's "
        "inputs"
    )


def test_ch04_qdq_linear_onnx_scales_the_weight_per_output_channel(ch04):
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(8, 32, generator=g), torch.randn(4, 32, generator=g)
    w[0] *= 1000  # one loud channel: a per-tensor weight scale would flatten the others
    x_scale = float(x.abs().max()) / 127
    got = run_onnx(ch04.qdq_linear_onnx(w, x_scale), x)
    quiet = (got - x @ w.T)[:, 1:].abs().max().item()
    case = "qdq_linear_onnx(w [8, 32] whose row 0 is 1000x larger) in ORT"
    assert quiet < 1.0, (  # per channel: ~0.1 here; one scale for all: ~5
        f"{case}: expected an error under 1.0 on the 7 quiet output channels, got {quiet:.3g}; "
        "hint: one scale per output channel (axis 1 of the [in, out] weight), max |w| of the "
        "channel / 127"
    )
    ref = int8_linear(x, w, x_scale)
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-4), (
        f"{case}: expected the int8 fake-quantized linear, got max |diff| "
        f"{(got - ref).abs().max():.3g}; hint: the weight scale per output channel, the input "
        "scale per tensor, int8 zero points"
    )
