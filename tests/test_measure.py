"""The measuring helpers measure what they say: byte counts worked out by hand,
call counts and orders, and time splits of functions whose ops we know.

No test asserts a duration: the machines are shared and noisy.
"""

from __future__ import annotations

import math
import mmap

import pytest
import torch
import torch.nn.functional as F

from minillm.lab import (
    Roofline,
    count_flops,
    cpu_name,
    format_bytes,
    machine_info,
    measure_roofline,
    paired_ratios,
    peak_tensor_bytes,
    profile_split,
    rss_bytes,
    saved_tensor_bytes,
    time_interleaved,
    time_ratios,
    time_samples,
    trace_tensor_memory,
)

N = 1000  # elements; float32 -> 4000 bytes per buffer
BUF = 4 * N


# ---------------------------------------------------------------------------- timing


def test_interleaving_calls_each_fn_warmup_plus_repeats_times_rotating_the_order():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = time_samples(fns, repeats=4, warmup=2)
    assert {k: len(v) for k, v in samples.items()} == {"a": 4, "b": 4, "c": 4}
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 6
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)  # each round runs all
    assert [r[0] for r in rounds] == ["a", "b", "c", "a", "b", "c"]  # who goes first rotates


def test_time_interleaved_returns_one_positive_median_per_function():
    times = time_interleaved({"x": lambda: sum(range(100)), "y": lambda: None}, repeats=3)
    assert set(times) == {"x", "y"}
    assert all(t > 0 and math.isfinite(t) for t in times.values())


def test_paired_ratios_divide_within_each_round_then_take_the_median():
    samples = {"a": [1.0, 2.0, 3.0], "b": [2.0, 2.0, 9.0]}
    # per round a/b: 0.5, 1.0, 0.333 -> median 0.5 (a ratio of medians would say 2/2 = 1.0)
    assert paired_ratios(samples, "b") == {"a": pytest.approx(0.5), "b": 1.0}


def test_time_ratios_time_each_function_in_alternation_with_the_baseline():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("base", "x", "y")}
    ratios = time_ratios(fns, "base", repeats=3, warmup=1)
    assert list(ratios) == ["base", "x", "y"] and ratios["base"] == 1.0
    assert all(r > 0 for r in ratios.values())
    # one A/B run per function: x and base alternate, then y and base
    assert calls == ["x", "base", "base", "x"] * 2 + ["y", "base", "base", "y"] * 2


# ---------------------------------------------------------------- saved for backward


def test_saved_bytes_of_a_known_chain_count_each_buffer_once():
    x = torch.randn(N, requires_grad=True)

    def chain():
        a = x.exp()  # ExpBackward saves its result a
        b = a.sin()  # SinBackward saves its input: a again, no new bytes
        c = b * 3  # multiplying by a Python number saves no tensor
        return c.tanh()  # TanhBackward saves its result: a second buffer

    assert saved_tensor_bytes(chain) == 2 * BUF


def test_saved_bytes_exclude_weights_and_dedupe_views():
    x = torch.randn(N, requires_grad=True)
    assert saved_tensor_bytes(lambda: x.sin()) == BUF  # sin saves its input x
    assert saved_tensor_bytes(lambda: x.sin(), exclude=[x]) == 0
    a = torch.randn(N, requires_grad=True).exp()  # a non-leaf buffer
    views = lambda: (a[: N // 2].sin(), a[N // 2 :].sin())  # noqa: E731
    assert saved_tensor_bytes(views) == BUF  # two views, one storage


def test_saved_bytes_of_linear_are_its_input_when_the_weight_is_excluded():
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    assert saved_tensor_bytes(lambda: layer(x), exclude=layer.parameters()) == x.nbytes


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_nothing_is_saved_without_grad(mode):
    x = torch.randn(N, requires_grad=True)
    with mode():
        assert saved_tensor_bytes(lambda: x.exp().sin().tanh()) == 0


# ---------------------------------------------------------------------- peak memory


def test_peak_counts_only_buffers_alive_at_once_without_grad():
    x = torch.randn(N)

    def chain():
        y = x * 2
        z = y * 2  # y and z alive: the peak, two buffers
        del y
        return z * 2  # z and the result alive: two buffers again

    trace = trace_tensor_memory(chain)
    assert trace.peak_bytes == 2 * BUF
    assert trace.end_bytes == BUF  # only the returned tensor outlives the call
    assert trace.allocated_bytes == 3 * BUF
    assert trace.allocations == 3
    assert peak_tensor_bytes(chain) == 2 * BUF


def test_autograd_keeps_saved_buffers_alive_after_python_drops_them():
    x = torch.randn(N, requires_grad=True)

    def chain():
        y = x.exp()  # saved by ExpBackward
        z = y.exp()  # saved too
        del y  # the graph still holds it
        return z.exp()

    trace = trace_tensor_memory(chain)
    assert trace.peak_bytes == trace.end_bytes == 3 * BUF
    with torch.no_grad():
        assert trace_tensor_memory(chain).end_bytes == BUF


def test_views_and_existing_weights_are_not_allocations():
    x = torch.randn(32, 32)
    layer = torch.nn.Linear(32, 16, bias=False)
    trace = trace_tensor_memory(lambda: x.view(-1).view(32, 32).t())
    assert (trace.peak_bytes, trace.allocations) == (0, 0)
    with torch.no_grad():
        out_bytes = 32 * 16 * 4
        assert peak_tensor_bytes(lambda: layer(x)) == out_bytes  # the output, not the weight


def test_rss_grows_when_a_large_tensor_is_touched():
    # The tensor lives on a fresh anonymous mapping, whose pages become resident only when
    # written. A plain torch.ones(...) may land on pages the allocator already holds from
    # earlier tests: CI once saw RSS not move at all, 1.9 GB into the suite.
    size = 64 * 2**20
    with mmap.mmap(-1, size) as pages:
        before = rss_bytes()
        big = torch.frombuffer(pages, dtype=torch.float32)
        big.fill_(1.0)  # every page written
        grew = rss_bytes() - before
        del big
    assert grew > size // 2


# ------------------------------------------------------------------- which machine

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
"""


def test_cpu_name_tells_cpus_with_one_marketing_name_apart():
    assert cpu_name(ZEN4) == "AMD EPYC (family 25 model 17)"
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nProcessor\t: ARMv8 rev 1 (v8l)\n"
    assert cpu_name(arm) == "ARMv8 rev 1 (v8l)"  # no family / model numbers on ARM


def test_machine_info_records_what_a_ratio_depends_on():
    info = machine_info(threads=3)
    assert info["threads"] == 3 and info["torch"] == torch.__version__
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["cores"] >= 1 and info["cpu"]


# ------------------------------------------------------------------- where time goes


def test_profile_split_counts_the_ops_and_kernels_of_a_known_function():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    split = profile_split(lambda: torch.mm(a, b).add(1), repeats=3, warmup=1)
    assert (split.ops, split.kernels) == (2, 2)
    parts = split.kernel_s + split.framework_s + split.python_s
    assert parts == pytest.approx(split.wall_s, rel=1e-6)
    assert sum(split.fractions().values()) == pytest.approx(1.0)


def test_a_linear_layer_is_one_kernel_and_views_are_none():
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    assert profile_split(lambda: F.linear(x, w, b), repeats=2, warmup=1).kernels == 1
    views = profile_split(lambda: x.view(-1).t().unsqueeze(0), repeats=2, warmup=1)
    assert views.kernels == 0 and views.kernel_fraction == 0


def test_pure_python_time_is_all_overhead():
    split = profile_split(lambda: sum(range(2000)), repeats=3, warmup=1)
    assert split.ops == 0
    assert split.fractions()["Python"] == pytest.approx(1.0)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


# ------------------------------------------------------------------------------ roofline


def test_flops_of_a_matmul_and_of_cpu_attention_are_counted_by_hand():
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 32
    assert count_flops(lambda: (a * 2).relu()) == 0  # elementwise: not arithmetic-bound
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    attn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    # q @ k^T and probs @ v: 2 matmuls of (10 x 8) by (8 x 10) per head, 4 heads
    assert count_flops(attn) == 2 * (2 * 4 * 10 * 10 * 8)


def test_roofline_takes_the_slower_of_arithmetic_and_memory():
    roof = Roofline(flops_per_s=1e9, bytes_per_s=1e8)
    assert roof.seconds(flops=2e9, bytes_moved=1e6) == pytest.approx(2.0)  # compute-bound
    assert roof.seconds(flops=1e3, bytes_moved=5e8) == pytest.approx(5.0)  # memory-bound


def test_measure_roofline_returns_positive_ceilings():
    roof = measure_roofline(matmul_size=128, copy_bytes=2**20, repeats=1)
    assert roof.flops_per_s > 0 and roof.bytes_per_s > 0 and roof.read_bytes_per_s > 0
