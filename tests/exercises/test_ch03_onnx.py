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
    torch.testing.assert_close(ch03.clip_by_max_norm(big, 2.0), big * (2.0 / peak))
    assert ch03.clip_by_max_norm(big, 2.0).abs().max().item() == pytest.approx(2.0)
    small = x / x.abs().max()  # peak exactly 1
    assert torch.equal(ch03.clip_by_max_norm(small, 1.5), small), "under the bound: unchanged"
    zeros = ch03.clip_by_max_norm(torch.zeros(4), 1.0)
    assert torch.equal(zeros, torch.zeros(4)), "all zeros must stay zeros (no NaN)"


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
        torch.testing.assert_close(ort_run(path, x=x), expected, atol=TOL, rtol=0)


# ------------------------------------------------------------------------- lower_median


def test_ch03_lower_median_eager(ch03):
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (4,), (1,), (2, 3, 5), (3, 6)]:
        x = torch.randn(shape, generator=g)
        got = ch03.lower_median(x)
        assert got.shape == shape[:-1], f"shape {tuple(got.shape)} for input {shape}"
        assert torch.equal(got, torch.median(x, dim=-1).values), f"input {shape}"
    assert ch03.lower_median(torch.tensor([1.0, 2.0, 3.0, 10.0])).item() == 2.0, "lower median"


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
    torch.testing.assert_close(ort_run(path, x=x), torch.median(x, dim=-1).values)


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


def test_ch03_padded_causal_mask_eager(ch03):
    mask = left_padded([5, 2, 3], 5)
    for t in (1, 2, 5):
        got = ch03.padded_causal_mask(mask, t)
        assert got.dtype == torch.bool and got.shape == (3, 1, t, 5), (got.dtype, got.shape)
        assert torch.equal(got, brute_force_mask(mask, t)), f"query_len={t}"
    full = ch03.padded_causal_mask(torch.ones(1, 4, dtype=torch.long), 4)[0, 0]
    assert torch.equal(full, torch.ones(4, 4).tril().bool()), "no padding: plain causal mask"
    assert ch03.padded_causal_mask(mask.bool(), 2).shape == (3, 1, 2, 5), "bool masks too"


def test_ch03_padded_causal_mask_keeps_padding_rows_finite(ch03):
    """A left-padded row through SDPA: no NaN anywhere, and real queries ignore padding."""
    mask = left_padded([2, 4], 4)
    q, k, v = torch.randn(3, 2, 2, 4, 8).unbind(0)
    attn = ch03.padded_causal_mask(mask, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn)
    assert not out.isnan().any(), "a fully masked row gives NaN: let each query see itself"
    alone = torch.nn.functional.scaled_dot_product_attention(
        q[:1, :, 2:], k[:1, :, 2:], v[:1, :, 2:], is_causal=True
    )
    torch.testing.assert_close(out[:1, :, 2:], alone, atol=1e-6, rtol=0)


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
        assert torch.equal(got, brute_force_mask(mask, t)), f"lengths {lengths}, T={t}"
