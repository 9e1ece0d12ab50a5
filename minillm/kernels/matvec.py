"""A decode step's matrix-vector products on a CPU, in C: fp32 weights (`matvec.c`) and
int8 / Q4_1-style int4 codes (`qmatvec.c`).

A decode step multiplies one row by every weight matrix: it does one multiply-add per 4
bytes it reads, so it runs at the speed the kernel streams the weights from memory.
PyTorch's `F.linear` hands that product to its BLAS, which on one core streams SmolLM2's
weights at about half the read bandwidth (chapter 02 measures it); llama.cpp is faster
there because it brings its own vectorized dot product per weight row. `matvec.c` does
the same: each row of W [out, in] is read once, as one contiguous stream, and dotted with
up to four input rows at a time, which stay in cache.

The C files are compiled once per machine on first use (`cc -O3 -march=native`, a second
or two, into `$MINILLM_CACHE/kernels/`) and called through ctypes. Where there is no C
compiler, `matvec_status()` says so; nothing else changes. Past `MAX_ROWS` rows (a prefill,
a large batch of decodes) the product is a matrix product that BLAS runs well:
`try_matvec` says so by returning None, and the caller keeps `F.linear`. The model layer
that uses it is `minillm.model.layout.MatVecLinear`.

The quantized products (`Int8Product`, `Q4Product`) read the weights as codes and round
each row of x to int8 per block of 32 inputs, as llama.cpp does, so that a block's dot
product is an integer one (the header of `qmatvec.c` says how); they take any number of
rows, each computed alone. `minillm.quant.cpu_kernels` holds the layers' side.

The same library holds `rowops.c` (RMSNorm, rotary embedding, decode attention: see
`minillm.kernels.rowops`), so one compile serves every CPU kernel of the course.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from minillm.paths import cache_root

SOURCES = tuple(Path(__file__).with_name(f) for f in ("matvec.c", "qmatvec.c", "rowops.c"))
MAX_ROWS = 8  # past this (about 12 on SmolLM2's shapes, one core) BLAS's matrix product wins


def _flags() -> list[str]:
    arch = "-mcpu=native" if platform.machine() in ("arm64", "aarch64") else "-march=native"
    return ["-O3", arch, "-fopenmp-simd", "-shared", "-fPIC"]


def _machine_key() -> str:
    """What `-march=native` compiled for: the CPU's feature flags where Linux lists them."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = [ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")]
        return flags[0] if flags else platform.processor()
    return platform.platform() + platform.processor()


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled kernel, '') or (None, why not); compiled at most once per machine."""
    cc = os.environ.get("CC")
    compiler = shutil.which(cc) if cc else shutil.which("cc") or shutil.which("gcc")
    if compiler is None and cc:
        return None, f"CC={cc} is not a program here: point CC at a C compiler, or unset it"
    if compiler is None:
        return None, "no C compiler found: install one (apt install gcc; xcode-select --install)"
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES) + " ".join(_flags()).encode())
    key.update(_machine_key().encode())
    target = cache_root() / "kernels" / f"matvec-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # one atomic rename
                built = Path(tmp) / target.name
                cmd = [compiler, *_flags(), *map(str, SOURCES), "-o", str(built), "-lm"]
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    return None, f"{' '.join(cmd)} failed: {run.stderr.strip()[-500:]}"
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except OSError as err:  # a cache folder it cannot write, a library it cannot load
        return None, f"{err} (set MINILLM_CACHE to a folder this user can write)"
    return declare(lib), ""


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' C signatures (a library built from `SOURCES`), so ctypes passes 64-bit
    pointers and longs."""
    ptr, long, flt = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    signatures = {  # name: (argument types, return type)
        "matvec_f32": ([ptr] * 4 + [long] * 3, None),
        "matvec_int8": ([ptr] * 4 + [long] * 3, ctypes.c_int),
        "matvec_q4": ([ptr] * 5 + [long] * 3, ctypes.c_int),
        "rms_norm_f32": ([ptr] * 3 + [long] * 2 + [flt], None),
        "rope_f32": ([ptr] * 4 + [long] * 7, None),
        "decode_attention_f32": ([ptr] * 7 + [long] * 6 + [flt], ctypes.c_int),
        "paged_attention_f32": ([ptr] * 6 + [long] * 7 + [flt], ctypes.c_int),
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def matvec_status() -> tuple[bool, str]:
    """(the C kernel runs here, '' or the reason it cannot)."""
    lib, why = library()
    return lib is not None, why


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes this product: fp32 CPU tensors, no gradient wanted, a
    contiguous weight (and bias) whose inputs match x's last dimension, and at most
    `MAX_ROWS` rows. Checked on every call of a layer, so kept to plain attribute reads."""
    f32 = torch.float32
    if x.dtype != f32 or weight.dtype != f32 or not (x.is_cpu and weight.is_cpu):
        return False
    if bias is not None and (bias.dtype != f32 or not bias.is_cpu or not bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    inner = weight.shape[-1]
    return (
        weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == inner
        and x.numel() <= MAX_ROWS * inner
    )


def try_matvec(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` through the kernel, or None where it does not apply
    (`fits`) or cannot run here: the caller then keeps `F.linear`."""
    lib = library()[0]
    if lib is None or not fits(x, weight, bias):
        return None
    x = x.contiguous()
    out, inner = weight.shape
    y = x.new_empty(*x.shape[:-1], out)
    b = None if bias is None else bias.data_ptr()
    lib.matvec_f32(weight.data_ptr(), x.data_ptr(), b, y.data_ptr(), x.numel() // inner, out, inner)
    return y


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`try_matvec` that raises, naming why, where the kernel cannot take the product."""
    ok, why = matvec_status()
    if not ok:
        raise RuntimeError(f"the C matvec kernel cannot run here: {why}")
    y = try_matvec(x, weight, bias)
    if y is None:
        raise ValueError(
            f"matvec takes fp32 CPU tensors, a contiguous weight and at most {MAX_ROWS} rows; "
            f"got x {tuple(x.shape)} {x.dtype} on {x.device}, weight {tuple(weight.shape)} "
            f"{weight.dtype} (contiguous={weight.is_contiguous()}): use F.linear"
        )
    return y


BLOCK = 32  # inputs per block of x's int8 rounding (and per scale of q4's codes)


def _run(fn: Any, weights: tuple[int, ...], x: torch.Tensor, out: int, inner: int) -> torch.Tensor:
    """One call of a quantized kernel `fn` on the weights' pointers and x [..., inner]."""
    if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1] != inner:
        raise ValueError(
            f"the quantized C kernels take fp32 CPU inputs of {inner} features; got x "
            f"{tuple(x.shape)} {x.dtype} on {x.device}: cast it with x.float().cpu()"
        )
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "the quantized C kernels compute no gradient: run them under torch.no_grad() or "
            "torch.inference_mode(), or train through the dequantized weight"
        )
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], out)
    if fn(*weights, x.data_ptr(), y.data_ptr(), x.numel() // inner, out, inner) != 0:
        raise MemoryError("the quantized C kernel could not allocate its scratch rows")
    return y


def _weights(*named: tuple[str, torch.Tensor, torch.dtype]) -> ctypes.CDLL:
    """The library, after checking that each weight tensor is a C-contiguous CPU tensor of
    its dtype (the kernels read their memory as it is, every call)."""
    lib, why = library()
    if lib is None:
        raise RuntimeError(f"the C matvec kernel cannot run here: {why}")
    for name, t, dtype in named:
        if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device} "
                f"(contiguous={t.is_contiguous()}): pass t.to(torch.{str(dtype)[6:]}).contiguous()"
            )
    return lib


class Int8Product:
    """x -> x @ (q * scale[:, None]).T for int8 codes q [out, in] (in a multiple of 32)
    with one fp32 scale per output row, x rounded to int8 per block of 32. Checks the
    weights once; each call passes their addresses as they are (no copy)."""

    __slots__ = ("q", "scale", "fn", "weights", "out", "inner")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        lib = _weights(("q", q, torch.int8), ("scale", scale, torch.float32))
        self.out, self.inner = q.shape
        if self.inner % BLOCK or scale.numel() != self.out:
            raise ValueError(
                f"Int8Product takes in_features a multiple of {BLOCK} and one scale per row; "
                f"got q {tuple(q.shape)}, scale {tuple(scale.shape)}"
            )
        self.q, self.scale, self.fn = q, scale, lib.matvec_int8
        self.weights = (q.data_ptr(), scale.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self.fn, self.weights, x, self.out, self.inner)


class Q4Product:
    """x -> x @ W.T for Q4_1-style int4: W[j, 32b + k] = d[j, b] * code + m[j, b], the codes
    packed two a byte [out, in / 2] (input 2i in the low nibble), d and m fp16 [out, in / 32];
    x rounded to int8 per block of 32. Checks the weights once, as `Int8Product` does."""

    __slots__ = ("packed", "d", "m", "fn", "weights", "out", "inner")

    def __init__(self, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        f16 = torch.float16
        lib = _weights(("packed", packed, torch.uint8), ("d", d, f16), ("m", m, f16))
        self.out, self.inner = packed.shape[0], packed.shape[1] * 2
        blocks = (self.out, self.inner // BLOCK)
        if self.inner % BLOCK or tuple(d.shape) != blocks or tuple(m.shape) != blocks:
            raise ValueError(
                f"Q4Product takes in_features a multiple of {BLOCK} and d, m of shape {blocks}; "
                f"got packed {tuple(packed.shape)}, d {tuple(d.shape)}, m {tuple(m.shape)}"
            )
        self.packed, self.d, self.m, self.fn = packed, d, m, lib.matvec_q4
        self.weights = (packed.data_ptr(), d.data_ptr(), m.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self.fn, self.weights, x, self.out, self.inner)
