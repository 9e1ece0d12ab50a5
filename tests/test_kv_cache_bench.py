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


def test_long_context_sweep_times_both_attention_forms_beside_the_read(tiny_model):
    from minillm.bench import long_context

    model = tiny_model(num_attention_heads=4, num_key_value_heads=2)
    sweep = long_context.attention_sweep(model, [16, 32], repeats=2, read_bytes=2**20)
    rows = sweep["rows"]
    assert [r["context"] for r in rows] == [16, 32]
    assert rows[1]["kv_bytes"] == 2 * rows[0]["kv_bytes"] == 32 * sweep["kv_bytes_per_token"]
    for row in rows:
        for name in long_context.FORMS:
            t, share = row[name]["attention_s"], row[name]["fraction_of_read_bandwidth"]
            assert 0 < t["min"] <= t["median"] <= t["max"] and share["median"] > 0
    assert "growth_over_bytes" in rows[1]["grouped"]
    assert "growth_over_bytes" not in rows[0]["grouped"]
