"""Chapter 03 exercises, graded by exporting them to ONNX and running ONNX Runtime.

`ch03` is the module under test (`solutions.ch03_onnx`, or `exercises.ch03_onnx` with
MINILLM_IMPL=exercises). Each exercise is checked eagerly first (against torch and a
brute-force reference), then exported with `torch.onnx.export(..., dynamo=True)` and
dynamic shapes, validated with `onnx.checker`, and run on ORT on new shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from exercises.feedback import assert_close, worst
from minillm.export.onnx import export_module  # noqa: E402
from minillm.export.onnx_checks import check_onnx  # noqa: E402
from minillm.export.onnx_runtime import ort_session  # noqa: E402

TOL = 1e-5
DYN = torch.export.Dim.DYNAMIC


class Wrap(torch.nn.Module):
    """fn(x, *extra) as a module of one tensor input (extra: constants baked in)."""

    def __init__(self, fn, *extra) -> None:
        super().__init__()
        self.fn, self.extra = fn, extra

    def forward(self, x):
        return self.fn(x, *self.extra)


def ort_run(path, **inputs) -> torch.Tensor:
    feed = {k: v.numpy() for k, v in inputs.items()}
    return torch.from_numpy(ort_session(path).run(None, feed)[0])


def export(tmp_path, module, example, names, dynamic_shapes, dynamic_axes):
    path = export_module(module, example, tmp_path / "f.onnx", names, ["y"], dynamic_shapes)
    check_onnx(path, dynamic=dynamic_axes)
    return path


# --------------------------------------------------------------------- clip_by_max_norm


def test_ch03_clip_by_max_norm_eager(ch03):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g)
    big = x * 10
    peak = big.abs().max()
    case = f"clip_by_max_norm(x [3, 5] with max |x| = {float(peak):.3g}, max_abs=2.0)"
    assert_close(
        ch03.clip_by_max_norm(big, 2.0),
        big * (2.0 / peak),
        case,
        "over the bound, multiply the whole tensor by max_abs / max |x| (one factor for all "
        "elements), do not clamp each element",
    )
    top = ch03.clip_by_max_norm(big, 2.0).abs().max().item()
    assert top == pytest.approx(2.0), (
        f"{case}: expected the largest |value| to become 2.0, got {top:.6g}; hint: scale by "
        "max_abs / max |x|"
    )
    small = x / x.abs().max()  # peak exactly 1
    out = ch03.clip_by_max_norm(small, 1.5)
    assert torch.equal(out, small), (
        f"clip_by_max_norm(x with max |x| = 1, max_abs=1.5): expected x unchanged (under the "
        f"bound): {worst(out, small)}; hint: scale only when max |x| > max_abs"
    )
    zeros = ch03.clip_by_max_norm(torch.zeros(4), 1.0)
    assert torch.equal(zeros, torch.zeros(4)), (
        f"clip_by_max_norm(zeros(4), max_abs=1.0): expected zeros, got {zeros.tolist()}; "
        "hint: max_abs / 0 is inf and 0 * inf is nan: keep the division away from 0"
    )


def test_ch03_clip_by_max_norm_exports_both_branches(ch03, tmp_path):
    ch03.clip_by_max_norm(torch.ones(2), 1.0)  # not implemented yet: fail here, plainly
    path = export(
        tmp_path,
        Wrap(ch03.clip_by_max_norm, 2.0),
        (torch.randn(3, 4),),
        ["x"],
        ({0: DYN, 1: DYN},),
        {"x": {0: "rows", 1: "cols"}},
    )
    g = torch.Generator().manual_seed(1)
    for scale in (0.1, 10.0):  # one input under the bound, one over: both branches in ORT
        x = torch.randn(5, 7, generator=g) * scale
        expected = x if x.abs().max() <= 2 else x * (2 / x.abs().max())
        assert_close(
            ort_run(path, x=x),
            expected,
            f"clip_by_max_norm(max_abs=2) exported to ONNX, run in ORT on x [5, 7] with "
            f"max |x| = {float(x.abs().max()):.3g}",
            "the exporter records one branch of a Python `if` on a tensor's value: compute "
            "both and pick with torch.where, so the graph holds both",
            atol=TOL,
            rtol=0,
        )


# ------------------------------------------------------------------------- lower_median


def test_ch03_lower_median_eager(ch03):
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (4,), (1,), (2, 3, 5), (3, 6)]:
        x = torch.randn(shape, generator=g)
        got = ch03.lower_median(x)
        assert got.shape == shape[:-1], (
            f"lower_median(x {list(shape)}): expected shape {shape[:-1]}, got "
            f"{tuple(got.shape)}; hint: reduce the last dim only (gather an index of shape "
            "[..., 1], then squeeze(-1))"
        )
        want = torch.median(x, dim=-1).values
        assert torch.equal(got, want), (
            f"lower_median(x {list(shape)}) vs torch.median(x, dim=-1).values: "
            f"{worst(got, want)}; hint: sort the last dim and take the element at index "
            "(n - 1) // 2 of each row"
        )
    middle = ch03.lower_median(torch.tensor([1.0, 2.0, 3.0, 10.0])).item()
    assert middle == 2.0, (
        f"lower_median([1, 2, 3, 10]): expected 2.0 (the lower of the two middle values), got "
        f"{middle}; hint: index (n - 1) // 2 of the sorted values, not n // 2 or a mean"
    )


def test_ch03_lower_median_exports(ch03, tmp_path):
    ch03.lower_median(torch.ones(3))  # not implemented yet: fail here, plainly
    path = export(
        tmp_path,
        Wrap(ch03.lower_median),
        (torch.randn(3, 6),),
        ["x"],
        ({0: DYN},),
        {"x": {0: "rows"}},
    )
    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(2))
    assert_close(
        ort_run(path, x=x),
        torch.median(x, dim=-1).values,
        "lower_median exported to ONNX on x [3, 6], run in ORT on x [9, 6]",
        "torch.median has no ONNX translation: sort, then gather; build the index from x's "
        "shape at run time so the rows stay dynamic",
    )


# ------------------------------------------------------------------- padded_causal_mask


def brute_force_mask(attention_mask: torch.Tensor, t: int) -> torch.Tensor:
    B, S = attention_mask.shape
    out = torch.zeros(B, 1, t, S, dtype=torch.bool)
    for b in range(B):
        for i in range(t):
            q = S - t + i
            for s in range(S):
                out[b, 0, i, s] = (s <= q and bool(attention_mask[b, s])) or s == q
    return out


def left_padded(lengths: list[int], total: int) -> torch.Tensor:
    return torch.stack([(torch.arange(total) >= total - n).long() for n in lengths])


MASK_HINT = (
    "the queries are the last T of the S slots (query i at slot S - T + i); it sees slot s "
    "when s <= its slot and attention_mask[b, s] is 1, and it always sees itself"
)


def test_ch03_padded_causal_mask_eager(ch03):
    mask = left_padded([5, 2, 3], 5)
    for t in (1, 2, 5):
        got = ch03.padded_causal_mask(mask, t)
        case = f"padded_causal_mask(left-padded lengths [5, 2, 3] in 5 slots, query_len={t})"
        assert got.dtype == torch.bool, (
            f"{case}: expected dtype torch.bool, got {got.dtype}; hint: combine comparisons "
            "with & and |, and turn attention_mask into bool (.bool())"
        )
        assert got.shape == (3, 1, t, 5), (
            f"{case}: expected shape (3, 1, {t}, 5), got {tuple(got.shape)}; hint: "
            "[B, 1, T, S], the 1 the heads axis that SDPA broadcasts over"
        )
        want = brute_force_mask(mask, t)
        assert torch.equal(got, want), f"{case}: {worst(got, want)}; hint: {MASK_HINT}"
    full = ch03.padded_causal_mask(torch.ones(1, 4, dtype=torch.long), 4)[0, 0]
    assert torch.equal(full, torch.ones(4, 4).tril().bool()), (
        f"padded_causal_mask(no padding, 4 slots, query_len=4): expected the plain causal mask "
        f"(lower triangle), got {full.int().tolist()}; hint: {MASK_HINT}"
    )
    shape = tuple(ch03.padded_causal_mask(mask.bool(), 2).shape)
    assert shape == (3, 1, 2, 5), (
        f"padded_causal_mask(a bool attention_mask [3, 5], query_len=2): expected shape "
        f"(3, 1, 2, 5), got {shape}; hint: take bool masks as well as 0/1 integers"
    )


def test_ch03_padded_causal_mask_keeps_padding_rows_finite(ch03):
    """A left-padded row through SDPA: no NaN anywhere, and real queries ignore padding."""
    mask = left_padded([2, 4], 4)
    q, k, v = torch.randn(3, 2, 2, 4, 8).unbind(0)
    attn = ch03.padded_causal_mask(mask, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn)
    case = "SDPA with padded_causal_mask(left-padded lengths [2, 4] in 4 slots, query_len=4)"
    assert not out.isnan().any(), (
        f"{case}: expected no NaN, got {int(out.isnan().sum())} NaN values; hint: a padding "
        "query that sees no slot gives a softmax over all -inf = NaN: let each query see itself"
    )
    alone = torch.nn.functional.scaled_dot_product_attention(
        q[:1, :, 2:], k[:1, :, 2:], v[:1, :, 2:], is_causal=True
    )
    assert_close(
        out[:1, :, 2:],
        alone,
        f"{case}: the 2 real queries of the padded row vs that row without its padding",
        "real queries must not see padding slots: AND the causal mask with attention_mask",
        atol=1e-6,
        rtol=0,
    )


def test_ch03_padded_causal_mask_exports_with_dynamic_shapes(ch03, tmp_path):
    ch03.padded_causal_mask(torch.ones(1, 2), 1)  # not implemented yet: fail here, plainly

    class MaskGraph(torch.nn.Module):
        def forward(self, attention_mask, input_ids):
            return ch03.padded_causal_mask(attention_mask, input_ids.shape[1])

    path = export(
        tmp_path,
        MaskGraph(),
        (left_padded([4, 6], 6), torch.zeros(2, 3, dtype=torch.long)),
        ["attention_mask", "input_ids"],
        ({0: DYN, 1: DYN}, {0: DYN, 1: DYN}),
        {"attention_mask": {0: "batch", 1: "slots"}, "input_ids": {0: "batch", 1: "queries"}},
    )
    for lengths, total, t in [([3, 7, 1], 7, 1), ([5], 5, 5), ([2, 9], 9, 4)]:
        mask = left_padded(lengths, total)
        ids = torch.zeros(len(lengths), t, dtype=torch.long)
        got = ort_run(path, attention_mask=mask, input_ids=ids)
        want = brute_force_mask(mask, t)
        assert torch.equal(got, want), (
            f"padded_causal_mask exported to ONNX on 2 rows of 6 slots, T=3, run in ORT with "
            f"lengths {lengths} in {total} slots, T={t}: {worst(got, want)}; hint: build it from "
            "shapes (torch.arange(S), S - T), no Python `if` on the mask's values"
        )
