"""benchmarks/quant_methods.py (over `minillm.bench.quant_methods`): its one-pass scorer
equals the course's evaluator, and a small run produces the table and the SUMMARY line."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import awq_scales as awq_scales_script
from benchmarks import quant_methods as quant_methods_script
from minillm import load_tokenizer
from minillm.bench import awq_scales, quant_methods
from minillm.quant import quantize_model
from minillm.quant.calibrate import calibration_batches
from minillm.training import held_out_ids, next_token_agreement, perplexity


def test_score_equals_perplexity_and_agreement(model) -> None:
    ids = held_out_ids(load_tokenizer())[: 3 * 64 + 1]
    x, y = quant_methods.windows(ids, 3, window=64)
    q = quantize_model(copy.deepcopy(model), "int4-g32")
    top1 = model(x).argmax(-1)
    ppl, agree = quant_methods.score(q, x, y, top1, batch=2)
    assert ppl == pytest.approx(perplexity(q, ids, 64, max_windows=3), rel=1e-5)
    assert agree == pytest.approx(next_token_agreement(model, q, ids, 64, max_windows=3))


def test_a_small_run_prints_its_table(capsys) -> None:
    result = quant_methods_script.main(
        ["--only", "FP8", "AWQ", "asym", "--windows", "2", "--calib", "1", "--quick"]
        + ["--alphas", "0.5"]
    )
    rows = result["rows"]
    assert {"fp32", "RTN int4 g128", "AWQ int4 g128", "FP8 e4m3 W(ch)+A(tensor)"} <= set(rows)
    assert "GPTQ int4 g128" not in rows  # --only left it out
    assert rows["fp32"]["ppl_delta"] == 0 and rows["RTN int4 g128"]["speed"] > 0
    assert rows["AWQ int4 g128"]["bytes"] == rows["RTN int4 g128"]["bytes"]
    assert rows["AWQ int4 g128 (duo scaling)"]["bytes"] == rows["RTN int4 g128"]["bytes"]
    out = capsys.readouterr().out
    assert "SUMMARY quant_methods bundled" in out and "AWQ (duo scaling)" in out
    assert "W8A8 per-token-asym" in rows and "SmoothQuant searched per-token-asym" in out


def test_awq_scales_compares_the_families_on_training_text_only() -> None:
    """The default's evidence: the unseen pieces are training text the calibration batches
    do not contain, and every family gets a recovery on both texts."""
    tok = load_tokenizer()
    calib = torch.cat(calibration_batches(tok, n_batches=4, batch_size=4, seq_len=256))
    unseen = awq_scales.other_training_pieces(tok)
    held_out = held_out_ids(tok)
    assert unseen.shape == calib.shape
    assert not any(torch.equal(u, c) for u in unseen for c in calib)
    assert not torch.equal(unseen[0], held_out[: unseen.shape[1]])
    result = awq_scales_script.main(["--model", "bundled"])
    ppl = result["perplexity"]
    assert set(result["recovered"]) == {"AWQ act", "AWQ duo"}
    assert all(ppl["fp32"][t] < ppl["RTN"][t] for t in ("fitted", "unseen"))
