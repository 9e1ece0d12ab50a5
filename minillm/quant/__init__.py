"""Quantization from scratch (chapter 06: INT8, INT4, NF4 and `QuantLinear`) and what
TensorRT does to a model (chapter 04: INT8 calibration in `calibrate`, layer fusion in
`fusion`)."""

from minillm.quant.formats import (
    DQ_BLOCK,
    NF4_CODE,
    Int4Weight,
    NF4Weight,
    absmax_quantize,
    dequantize,
    nf4_code_from_normal,
    pack_int4,
    quantize_int4,
    quantize_nf4,
    quantize_q4_1,
    unpack_int4,
    zeropoint_quantize,
)
from minillm.quant.linear import (
    SCHEME_HELP,
    QuantLinear,
    Scheme,
    activation_absmax,
    fake_quant_activations,
    linear_names,
    parse_scheme,
    quantization_error,
    quantize_model,
    set_activation_quant,
    weight_bytes,
)

__all__ = [
    "DQ_BLOCK",
    "Int4Weight",
    "NF4Weight",
    "NF4_CODE",
    "QuantLinear",
    "SCHEME_HELP",
    "Scheme",
    "absmax_quantize",
    "activation_absmax",
    "dequantize",
    "fake_quant_activations",
    "linear_names",
    "nf4_code_from_normal",
    "pack_int4",
    "parse_scheme",
    "quantization_error",
    "quantize_int4",
    "quantize_model",
    "quantize_nf4",
    "quantize_q4_1",
    "set_activation_quant",
    "unpack_int4",
    "weight_bytes",
    "zeropoint_quantize",
]
