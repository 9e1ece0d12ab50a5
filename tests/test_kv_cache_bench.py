"""minillm.bench.kv_cache's cached-step sweep: a median and quartiles for every length."""

from __future__ import annotations

import torch

from minillm.bench import kv_cache as bench


def test_cached_step_sweep_reports_quartiles_for_every_length():
    torch.manual_seed(0)
    model = bench.long_context_model(64)
    sweep = bench.cached_step_sweep(model, [8, 32, 64], repeats=4, warmup=1)
    assert sweep["lengths"] == [8, 32, 64] and sweep["repeats"] == 4
    for q1, med, q3 in zip(sweep["q1_s"], sweep["median_s"], sweep["q3_s"], strict=True):
        assert 0 < q1 <= med <= q3
    assert all(len(sweep["samples_s"][n]) == 4 for n in (8, 32, 64))
