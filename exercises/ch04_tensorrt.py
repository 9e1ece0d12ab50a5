"""Chapter 04 exercises: INT8 calibration, the part of TensorRT you can build on a laptop.

An int8 engine stores each activation x as round(x / scale), clamped to -127..127, and
multiplies integers. The whole art is the choice of `scale = threshold / 127` for every
tensor: a threshold at the largest |x| wastes the grid on one outlier, a threshold too low
clips values that matter. Notebook 04 builds `minillm/quant/calibrate.py`; here you write the
pieces yourself:

    fake_quantize_int8       quantize and dequantize: int8's error, seen in fp32
    percentile_scale         the scale whose threshold is a percentile of |x|
    kl_threshold             TensorRT's (legacy) entropy calibration on a histogram of |x|
    calibrate_linear_inputs  forward hooks on a real model: one scale per nn.Linear input
    qdq_linear_onnx          explicit quantization: a linear as an ONNX Q/DQ graph, the
                             form TensorRT 10+ takes INT8 in

Replace each `raise NotImplementedError(...)` with your code, in plain torch. Grade with

    make grade CH=04    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch04

and one exercise with `-k "ch04 and percentile"`. The answers are in
`solutions/ch04_tensorrt.py`: try first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import onnx

QMAX = 127


def fake_quantize_int8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Symmetric int8 quantize-dequantize: what x becomes after a trip through int8.

        q = clamp(round(x / scale), -127, 127)      the integer an int8 kernel sees
        return q * scale                            back in x's units (fp32)

    `scale` is a number (one scale for the whole tensor, as for activations) or a
    tensor that broadcasts against x (e.g. [out, 1] for one scale per output channel
    of a weight). TensorRT's int8 is symmetric and leaves -128 unused, so the grid is
    -127..127 and zero is exactly representable.

    Properties the tests check: for |x| <= 127 * scale the error is at most scale / 2
    (rounding to the nearest step); larger values saturate to +-127 * scale; quantizing
    a value already on the grid returns it unchanged.

    Pitfalls: `torch.round` rounds halves to even, which is fine; do not use `int()`
    or `.long()` (they truncate toward zero); clamp before multiplying back.
    """
    raise NotImplementedError("ch04: implement fake_quantize_int8")


def percentile_scale(x: torch.Tensor, percentile: float = 99.99) -> float:
    """The int8 scale whose clipping threshold is the `percentile`-th percentile of |x|.

        threshold = the value below which `percentile`% of the |x| values lie
        scale     = threshold / 127

    Percentile calibration trades a little clipping error on the rarest values for a
    finer grid for all the others: on a gaussian with a handful of outliers at 50
    sigma, the max method puts ~2.5 steps of the grid inside one sigma, the 99.99th
    percentile ~32.

    Use the exact percentile of the values (sorting, `torch.kthvalue` or
    `torch.quantile`; mind that `torch.quantile` refuses inputs above 16M elements),
    not a histogram. Return a Python float > 0 (a tensor of zeros must not give a
    zero scale: floor it at 1e-12).

    Raise ValueError for a percentile outside (0, 100].
    """
    raise NotImplementedError("ch04: implement percentile_scale")


def kl_threshold(hist: torch.Tensor, bin_width: float, levels: int = 128) -> float:
    """TensorRT's (legacy) entropy calibration: the threshold that loses the least information.

    (TensorRT's implicit calibrators, this one included, are deprecated since TensorRT 10:
    the threshold is now chosen before the build and written into the graph as Q/DQ
    nodes, `qdq_linear_onnx` below. The search itself is unchanged.)

    `hist[b]` counts the |x| values in [b * bin_width, (b + 1) * bin_width), over all
    the calibration data (2048 bins from 0 to max |x| in TensorRT). For each candidate
    i = levels, levels + 1, ..., len(hist) (keep the first i bins):

      P = hist[:i], with the counts of every bin beyond (hist[i:].sum()) added to its
          last bin: clipping moves those values to the threshold.
      Q = hist[:i] as int8 would see it: split the i bins into `levels` groups of
          adjacent bins (one group per int8 level; group sizes differ by at most one
          when i is not a multiple of `levels`), and give every *non-empty* bin of a
          group the group's total divided by its number of non-empty bins. Empty bins
          stay empty.
      KL(P || Q) = sum over bins with P > 0 of p * log(p / q), after normalising both
          to sum to 1 (skip a candidate where some q is 0 while p > 0).

    Return the upper edge of the best candidate's last bin: best_i * bin_width.

    What it does: a long sparse tail (outliers) costs little information when clipped,
    so KL picks a threshold inside the bulk of the distribution; a distribution with no
    tail (uniform) keeps almost everything. Note the smallest possible threshold is
    `levels` bins: with 2048 bins over [0, max], KL cannot clip below max/16.

    Pitfalls: an off-by-one between bins and edges; forgetting the outliers in P (then
    P and Q see the same bins and every cut looks free); a pure-Python loop over every
    bin of every candidate is slow (2048 bins: ~2000 candidates): vectorise one
    candidate with `index_add_` or `torch.bincount`.
    """
    raise NotImplementedError("ch04: implement kl_threshold")


def calibrate_linear_inputs(
    model: nn.Module, batches: list[torch.Tensor], percentile: float = 99.99
) -> dict[str, float]:
    """Calibrate a real model: the percentile scale of the input of every nn.Linear.

    For every module `m` of `model` that is an `nn.Linear` (name from
    `model.named_modules()`, e.g. "model.layers.0.mlp.down_proj"), register a forward
    *pre*-hook (`m.register_forward_pre_hook(fn)`, `fn(module, args)`; `args[0]` is the
    input tensor) that keeps |input| of every call. Run the model on each batch of token
    ids (under `torch.inference_mode()`), remove the hooks (also when the forward raises:
    try/finally), and return {name: percentile_scale(all values seen, percentile)}.

    The tests plug your scales into `minillm.quant.calibrate.fake_quantize_model`: every linear
    then quantizes its input to int8 with your scale and its weight per channel, and the
    model's held-out perplexity must stay within 5% of fp32 with >= 90% of next-token
    predictions unchanged.

    Pitfalls: a lambda in a loop sees the loop variable's *last* value (bind `name` as a
    default argument); hooks left registered keep firing in later tests; q/k/v read the
    same tensor, which is fine (three equal entries).
    """
    raise NotImplementedError("ch04: implement calibrate_linear_inputs")


def qdq_linear_onnx(weight: torch.Tensor, input_scale: float) -> onnx.ModelProto:
    """Explicit quantization: y = x @ weight.T as an ONNX graph with QuantizeLinear /
    DequantizeLinear (Q/DQ) pairs, the form in which TensorRT 10+ takes INT8 (and FP8).

    `weight` is an nn.Linear weight [out, in]. Build, with `onnx.helper`:

        x [batch, in] -> QuantizeLinear(x_scale, x_zero) -> DequantizeLinear -> xq --+
                                                                                      MatMul -> y
        w_t [in, out] -> QuantizeLinear(w_scale, w_zero, axis=1) -> DequantizeLinear -+

    - input "x", float32, shape ["batch", in] (a named dim: any batch runs); output "y",
      float32, ["batch", out];
    - w_t = weight.T as a float32 initializer (`onnx.numpy_helper.from_array`);
    - x_scale = `input_scale` (a float32 scalar), one scale for the whole tensor, the
      value calibration chose;
    - w_scale: one scale per output channel, max |w| of that channel / 127 (float32, shape
      [out]); with w_t stored as [in, out] the output channel is axis 1 (the `axis`
      attribute of both Q and DQ);
    - zero points: int8 zeros (a scalar for x, [out] for w). Their dtype is what makes the
      Q output int8: a uint8 zero point would make it uint8. Symmetric int8 has zero 0.
    - `helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])` (per-axis
      Q/DQ needs opset 13 or later).

    ONNX Runtime runs it on a CPU (the tests do); TensorRT fuses DQ -> MatMul and runs an
    int8 GEMM. Inside the range (|x| <= 127 * input_scale) the result equals the fake
    quantization of `fake_quantize_int8`: Q computes clamp(round(x / scale), -128, 127).

    Pitfalls: the axis (0 would scale the input channels); scales as float32, not float64
    (ONNX is strict about types); a zero scale for an all-zero channel (floor it at 1e-12).
    Check your graph with `onnx.checker.check_model(model)`.
    """
    raise NotImplementedError("ch04: implement qdq_linear_onnx")
