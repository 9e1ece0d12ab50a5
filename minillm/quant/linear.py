"""A linear layer that stores its weight quantized (`QuantLinear`), the scheme names that
select a format, and the model-wide helpers: quantize every linear layer, count weight
bytes, find activation outliers.

`quantize_model(model, "int4-g128")` swaps every `nn.Linear` of a minillm model for a
`QuantLinear`. Activation quantization (W8A8) and LLM.int8()'s outlier decomposition are
simulated in `QuantLinear.forward` to show why per-tensor INT8 activations hurt.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from minillm.kernels.matvec import Int8Product, Q4Product
from minillm.quant.cpu_kernels import (
    Int4Kernel,
    Int8Kernel,
    c_skip_reason,
    int4_skip_reason,
    int8_skip_reason,
)
from minillm.quant.formats import (
    Int4Weight,
    NF4Weight,
    absmax_quantize,
    dequantize,
    quantize_int4,
    quantize_nf4,
    quantize_q4_1,
    zeropoint_quantize,
)

CpuKernel = Int8Kernel | Int4Kernel | Int8Product | Q4Product
BACKENDS = ("torch", "c")


@dataclass(frozen=True)
class Scheme:
    """A weight format: kind 'int8' | 'int4' | 'nf4', group size (0 = per channel / tensor);
    `float_min`: int4 with a per-group fp16 minimum instead of a zero point (Q4_1)."""

    kind: str
    group_size: int = 0
    symmetric: bool = True
    per_channel: bool = True
    double_quant: bool = False
    float_min: bool = False

    @property
    def bits(self) -> int:
        return 8 if self.kind == "int8" else 4


SCHEME_HELP = (
    "int8 | int8-asym | int8-tensor | int4-g<G> | int4sym-g<G> | q4_1-g<G> | nf4-g<G> | "
    "nf4-g<G>-dq (G = 32, 64, 128, ...)"
)


def parse_scheme(name: str) -> Scheme:
    """'int8' (symmetric per-channel), 'int8-asym', 'int8-tensor', 'int4-g128' (asymmetric,
    zero point), 'int4sym-g128', 'q4_1-g32' (llama.cpp's Q4_1: a float minimum), 'nf4-g64',
    'nf4-g64-dq' (double quantization)."""
    if name in ("int8", "int8-asym", "int8-tensor"):
        return Scheme("int8", symmetric=name != "int8-asym", per_channel=name != "int8-tensor")
    m = re.fullmatch(r"(int4|int4sym|q4_1|nf4)-g(\d+)(-dq)?", name)
    if not m or (m[3] and m[1] != "nf4"):
        raise ValueError(f"unknown quantization scheme {name!r}: use one of {SCHEME_HELP}")
    kind = "nf4" if m[1] == "nf4" else "int4"
    symmetric = m[1] in ("int4sym", "nf4")
    return Scheme(kind, int(m[2]), symmetric, double_quant=bool(m[3]), float_min=m[1] == "q4_1")


class QuantLinear(nn.Module):
    """An `nn.Linear` whose weight is stored quantized and dequantized at every forward.

    Weight-only by default (activations stay in the input dtype). `act` = 'tensor', 'token'
    or 'token-asym' also fake-quantizes the input to int8 (`fake_quant_activations`), and
    `outlier_threshold` keeps input columns with any |x| above it in full precision
    (LLM.int8()'s mixed-precision decomposition).
    """

    def __init__(
        self, linear: nn.Linear, scheme: str | Scheme, quantized: Int4Weight | None = None
    ) -> None:
        """`quantized`: codes already chosen by a smarter quantizer (GPTQ) for `linear`'s
        weight, stored as they are instead of rounding the weight to nearest."""
        super().__init__()
        self.scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
        if quantized is not None:
            _check_matches(quantized, self.scheme, linear)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.dtype = w.dtype
        s = self.scheme
        if s.kind == "int8":
            if s.symmetric:
                q, scale = absmax_quantize(w, 8, s.per_channel)
                zero = None
            else:
                q, scale, zero = zeropoint_quantize(w, 8, s.per_channel)
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)
        else:  # every tensor a buffer, so .to(device) moves them
            if quantized is not None:
                qw: Int4Weight | NF4Weight = quantized
            elif s.float_min:
                qw = quantize_q4_1(w, s.group_size)
            elif s.kind == "int4":
                qw = quantize_int4(w, s.group_size, s.symmetric)
            else:
                qw = quantize_nf4(w, s.group_size, s.double_quant)
            for field in fields(qw):
                value = getattr(qw, field.name)
                if isinstance(value, torch.Tensor) or value is None:
                    self.register_buffer(field.name, value)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.act: str | None = None
        self.outlier_threshold: float | None = None
        self.kernel: CpuKernel | None = None  # set by use_cpu_kernel

    def use_cpu_kernel(self, backend: str = "torch") -> str | None:
        """Run this layer on a CPU int8 / int4 kernel from now on: torch's ("torch") or
        minillm's C kernels ("c"), see `minillm.quant.cpu_kernels`; returns why not (and
        changes nothing) where the kernel does not apply to the scheme or shape."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        s = self.scheme
        if s.kind == "nf4":
            return "NF4 has no CPU kernel here (a table lookup, not an affine grid)"
        int8 = s.kind == "int8"
        if backend == "c":
            q = self.qweight if int8 else self.packed
            reason = c_skip_reason(q, self.scale, self.zero, None if int8 else self.qw)
        else:
            reason = (
                int8_skip_reason(self.qweight, self.scale, self.zero)
                if int8
                else int4_skip_reason(self.qw)
            )
        if reason is not None:
            return reason
        if backend == "torch":
            self.kernel = Int8Kernel(self.qweight, self.scale) if int8 else Int4Kernel(self.qw)
        elif int8:  # the layer's own codes and scales, as they are
            self.kernel = Int8Product(self.qweight, self.scale.reshape(-1).contiguous())
        else:
            self.kernel = Q4Product(self.packed, self.scale, self.minimum)
        return None

    @property
    def qw(self) -> Int4Weight | NF4Weight:
        """The packed weight as an `Int4Weight` / `NF4Weight` (4-bit schemes only)."""
        s = self.scheme
        if s.kind == "int4":
            return Int4Weight(self.packed, self.scale, self.zero, s.group_size, self.minimum)
        return NF4Weight(self.packed, self.absmax, s.group_size, self.dq_scale, self.dq_offset)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight [out, in] as the layer uses it, in the original dtype."""
        if self.scheme.kind == "int8":
            w = dequantize(self.qweight, self.scale, self.zero)
        else:
            w = self.qw.dequantize()
        return w.to(self.dtype)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the stored weight: codes + scales (+ zero points), bias not included."""
        if self.scheme.kind == "int8":
            return sum(t.nbytes for t in (self.qweight, self.scale, self.zero) if t is not None)
        return self.qw.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.act is None:
            y = self.kernel(x)
            return y if self.bias is None else y + self.bias
        w = self.dequantized_weight()
        if self.act is None:
            return F.linear(x, w, self.bias)
        return F.linear(fake_quant_activations(x, self.act, self.outlier_threshold), w, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


def _check_matches(qw: Int4Weight, scheme: Scheme, linear: nn.Linear) -> None:
    """A precomputed Int4Weight must be what `scheme` would store for `linear`."""
    shape = (linear.out_features, linear.in_features // 2)
    symmetric = qw.zero is None
    if (
        scheme.kind != "int4"
        or qw.group_size != scheme.group_size
        or symmetric != scheme.symmetric
        or (qw.minimum is not None) != scheme.float_min
        or tuple(qw.packed.shape) != shape
    ):
        raise ValueError(
            f"the precomputed Int4Weight (group {qw.group_size}, symmetric={symmetric}, float "
            f"minimum={qw.minimum is not None}, packed {tuple(qw.packed.shape)}) does not fit "
            f"scheme {scheme} on a linear of packed shape {shape}: quantize with the scheme's "
            "group size and symmetry"
        )


ACT_GRANULARITIES = ("tensor", "token", "token-asym")


def fake_quant_activations(
    x: torch.Tensor, granularity: str = "tensor", outlier_threshold: float | None = None
) -> torch.Tensor:
    """x rounded through int8: absmax with one scale per tensor ('tensor') or per token
    ('token'), or per token with a zero point ('token-asym': each row's min..max onto 256
    levels, vLLM's int8 "azp" activations and ORT's dynamic uint8 ones). The zero point
    pays off on one-sided rows, such as the SiLU-gated input of down_proj, whose negative
    half of a symmetric grid would go unused. The feature columns holding any
    |x| > outlier_threshold pass through unchanged."""
    if granularity not in ACT_GRANULARITIES:
        raise ValueError(f"granularity must be one of {ACT_GRANULARITIES}, got {granularity!r}")
    keep = None
    if outlier_threshold is not None:
        keep = (x.abs() > outlier_threshold).flatten(0, -2).any(0)  # outlier feature columns
        x_in = x.masked_fill(keep, 0.0)
    else:
        x_in = x
    flat = x_in.flatten(0, -2)
    if granularity == "token-asym":
        out = dequantize(*zeropoint_quantize(flat, 8, per_channel=True))
    else:
        out = dequantize(*absmax_quantize(flat, 8, per_channel=granularity == "token"))
    out = out.to(x.dtype).view(x.shape)
    return out if keep is None else torch.where(keep, x, out)


def linear_names(model: nn.Module) -> list[str]:
    """Names of every nn.Linear (or QuantLinear) in the model."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | QuantLinear)]


def quantize_model(
    model: nn.Module, scheme: str | Scheme, keep: Iterable[str] = ("lm_head",)
) -> nn.Module:
    """Replace every nn.Linear whose name does not end with one of `keep` by a QuantLinear,
    in place; returns the model.

    The default keeps `lm_head`: in tied models it is the embedding matrix, and a quantized
    head would be a second copy next to the full-precision embedding lookup.
    """
    keep = tuple(keep)
    unknown = [k for k in keep if not any(n.endswith(k) for n in linear_names(model))]
    if unknown:
        raise ValueError(f"keep={unknown} names no linear layer; layers: {linear_names(model)}")
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not name.endswith(keep)
    ]
    for name, mod in targets:
        replace_module(model, name, QuantLinear(mod, scheme))
    return model


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the sub-module `name` of `root` is (e.g. 'model.layers.0.mlp.up_proj')."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def set_activation_quant(
    model: nn.Module, granularity: str | None, outlier_threshold: float | None = None
) -> None:
    """Turn int8 activation fake-quantization on (a granularity of `ACT_GRANULARITIES`) or
    off (None) in every QuantLinear, with LLM.int8()'s outlier columns kept when
    `outlier_threshold` is set."""
    if granularity is not None and granularity not in ACT_GRANULARITIES:
        raise ValueError(f"granularity must be one of {ACT_GRANULARITIES}, got {granularity!r}")
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.act, mod.outlier_threshold = granularity, outlier_threshold


def use_cpu_kernels(model: nn.Module, backend: str = "torch") -> dict[str, str]:
    """Switch every QuantLinear of `model` to a CPU kernel (torch's, or minillm's C kernels
    with backend "c") where it applies; returns {layer name: why not} for the layers left
    on dequantize-then-matmul."""
    skipped = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear) and (reason := mod.use_cpu_kernel(backend)) is not None:
            skipped[name] = reason
    return skipped


def weight_bytes(model: nn.Module, only_linear: bool = False) -> int:
    """Bytes of the model's weights as stored: quantized codes and scales for QuantLinear,
    parameters elsewhere (a tied parameter counted once; a module storing its weight in a
    format of its own, like Fp8Linear, says its bytes in `weight_nbytes`). `only_linear`:
    linear layers only (the part quantization replaces)."""
    total, seen = 0, set()
    for mod in model.modules():
        stored = getattr(mod, "weight_nbytes", None)  # QuantLinear, Fp8Linear: as stored
        if stored is not None:
            total += stored
            continue
        if only_linear and not isinstance(mod, nn.Linear):
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in seen and not (only_linear and p.dim() == 1):
                seen.add(id(p))
                total += p.nbytes
    return total


@torch.inference_mode()
def activation_absmax(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per input feature, the largest |x| seen at the input of each linear layer while the
    model runs on `ids` [B, T]: where activation outliers live."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for name in linear_names(model):

        def hook(mod, args, name=name):
            amax = args[0].detach().abs().flatten(0, -2).amax(0).float()
            stats[name] = torch.maximum(stats[name], amax) if name in stats else amax

        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return stats


def quantization_error(w: torch.Tensor, scheme: str) -> float:
    """Relative error ||w - deq(q(w))|| / ||w|| of a 2-D weight under a scheme."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.detach().float()
    deq = QuantLinear(lin, scheme).dequantized_weight()
    return ((deq - lin.weight).norm() / lin.weight.norm()).item()
