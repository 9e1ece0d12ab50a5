"""INT8 calibration: thresholds on known distributions, fake-quant error bounds, and a
calibrated bundled model that stays close to fp32."""

from __future__ import annotations

import pytest
import torch

from minillm.model import load_tokenizer
from minillm.quant.calibrate import (
    QMAX,
    calibration_batches,
    collect_stats,
    compute_scales,
    entropy_threshold,
    fake_quantize,
    fake_quantize_model,
    histogram_stats,
    kl_curve,
    max_threshold,
    percentile_threshold,
    threshold,
    weight_scales,
)
from minillm.training import held_out_ids, next_token_agreement, perplexity

OUTLIERS = torch.tensor([40.0, -35.0, 30.0, 25.0, -50.0])


@pytest.fixture(scope="module")
def gaussian_with_outliers() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    return torch.cat([x, OUTLIERS])


def test_max_picks_the_outlier(gaussian_with_outliers):
    s = histogram_stats(gaussian_with_outliers)
    assert max_threshold(s) == pytest.approx(50.0)
    assert s.hist.sum() == gaussian_with_outliers.numel()


def test_percentile_and_entropy_clip_below_the_outliers(gaussian_with_outliers):
    s = histogram_stats(gaussian_with_outliers)
    pct = percentile_threshold(s, 99.99)
    kl = entropy_threshold(s)
    # |N(0,1)| has its 99.99th percentile at 3.89; one bin (50/2048) of slack either way.
    assert 3.89 - 0.05 < pct < 3.89 + 0.05
    # KL keeps the bulk of the gaussian (not less than 3 sigma) and drops the outliers.
    assert 3.0 < kl < 25.0
    assert kl < max_threshold(s) / 2


def test_percentile_of_a_uniform_distribution():
    x = torch.linspace(-1, 1, 100_001)
    s = histogram_stats(x)
    assert percentile_threshold(s, 90.0) == pytest.approx(0.9, abs=2 * s.bin_width)
    assert percentile_threshold(s, 100.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="percentile"):
        percentile_threshold(s, 0.0)


def test_entropy_does_not_clip_a_distribution_without_tail():
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(1)) * 2 - 1
    s = histogram_stats(x)
    assert entropy_threshold(s) > 0.9 * s.absmax


def test_the_kl_curve_is_what_entropy_minimises(gaussian_with_outliers):
    """The curve the notebook plots: one KL per candidate cut, its minimum the threshold."""
    s = histogram_stats(gaussian_with_outliers)
    thresholds, kl = kl_curve(s)
    assert len(thresholds) == len(kl) == 2048 - 128 + 1
    assert thresholds[0] == pytest.approx(128 * s.bin_width)
    assert thresholds[-1] == pytest.approx(s.absmax)
    assert entropy_threshold(s) == thresholds[kl.argmin()]
    # The smallest cut clips part of the gaussian and loses more than the best one, which
    # sits between the bulk and the outliers.
    assert kl[0] > 2 * kl.min() and 3.0 < thresholds[kl.argmin()] < 25.0
    with pytest.raises(ValueError, match="at least 128"):
        kl_curve(histogram_stats(gaussian_with_outliers, bins=64))


def test_unknown_method_is_a_clear_error(gaussian_with_outliers):
    with pytest.raises(ValueError, match="max, percentile, entropy"):
        threshold(histogram_stats(gaussian_with_outliers), "minmax")


def test_fake_quantize_error_bounds():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(2)) * 3
    scale = 4.0 / QMAX  # clips |x| > 4
    y = fake_quantize(x, scale)
    inside = x.abs() <= 4.0
    assert (y - x)[inside].abs().max() <= scale / 2 + 1e-6
    assert torch.allclose(y[~inside].abs(), torch.full_like(y[~inside], QMAX * scale))
    assert torch.equal(fake_quantize(y, scale), y)  # already on the grid
    assert len(torch.unique(y)) <= 2 * QMAX + 1


def test_weight_scales_are_per_output_channel():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    w[3] *= 100  # one loud row must not coarsen the others
    s = weight_scales(w)
    assert s.shape == (8, 1)
    err = (fake_quantize(w, s) - w).abs()
    assert (err <= s / 2 + 1e-6).all()
    assert err[0].max() < 0.05


@pytest.fixture(scope="module")
def stats(model):
    batches = calibration_batches(load_tokenizer(), n_batches=2, batch_size=2, seq_len=64)
    return collect_stats(model, batches)


def test_collect_stats_sees_every_linear_input(model, stats):
    tok = load_tokenizer()
    batches = calibration_batches(tok, n_batches=2, batch_size=2, seq_len=64)
    assert len(stats) == 7 * model.config.num_hidden_layers + 1  # + lm_head
    # The q/k/v projections read the same tensor: one shared stats object.
    a = stats["model.layers.0.self_attn.q_proj"]
    assert a is stats["model.layers.0.self_attn.v_proj"]
    # Check layer 0's attention input by hand: the first norm of the embeddings.
    layer0 = model.model.layers[0]
    with torch.inference_mode():
        xs = [layer0.input_layernorm(model.model.embed_tokens(b)) for b in batches]
    assert a.absmax == pytest.approx(max(float(x.abs().max()) for x in xs), rel=1e-6)
    assert a.hist.sum() == sum(x.numel() for x in xs)


def test_calibrated_model_stays_close_to_fp32(model, stats):
    ids = held_out_ids(load_tokenizer())
    kw = {"window": 128, "max_windows": 4}
    base = perplexity(model, ids, **kw)
    q = fake_quantize_model(model, compute_scales(stats, "percentile"))
    assert perplexity(q, ids, **kw) < base * 1.05
    assert next_token_agreement(model, q, ids, **kw) > 0.9
    # The original is untouched (fake_quantize_model works on a copy).
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert perplexity(model, ids, **kw) == base
