"""A decode step's matrix-vector products on a CPU, in forty lines of C (`matvec.c`).

A decode step multiplies one row by every weight matrix: it does one multiply-add per 4
bytes it reads, so it runs at the speed the kernel streams the weights from memory.
PyTorch's `F.linear` hands that product to its BLAS, which on one core streams SmolLM2's
weights at about half the read bandwidth (chapter 02 measures it); llama.cpp is faster
there because it brings its own vectorized dot product per weight row. `matvec.c` does
the same: each row of W [out, in] is read once, as one contiguous stream, and dotted with
up to four input rows at a time, which stay in cache.

The C file is compiled once per machine on first use (`cc -O3 -march=native`, under a
second, into `$MINILLM_CACHE/kernels/`) and called through ctypes. Where there is no C
compiler, `matvec_status()` says so; nothing else changes. Past `MAX_ROWS` rows (a prefill,
a large batch of decodes) the product is a matrix product that BLAS runs well:
`try_matvec` says so by returning None, and the caller keeps `F.linear`. The model layer
that uses it is `minillm.model.layout.MatVecLinear`.
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

import torch

from minillm.paths import cache_root

SOURCE = Path(__file__).with_name("matvec.c")
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
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled kernel, '') or (None, why not); compiled at most once per machine."""
    cc = os.environ.get("CC")
    compiler = shutil.which(cc) if cc else shutil.which("cc") or shutil.which("gcc")
    if compiler is None and cc:
        return None, f"CC={cc} is not a program here: point CC at a C compiler, or unset it"
    if compiler is None:
        return None, "no C compiler found: install one (apt install gcc; xcode-select --install)"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags()).encode())
    key.update(_machine_key().encode())
    target = cache_root() / "kernels" / f"matvec-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # one atomic rename
                built = Path(tmp) / target.name
                cmd = [compiler, *_flags(), str(SOURCE), "-o", str(built)]
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    return None, f"{' '.join(cmd)} failed: {run.stderr.strip()[-500:]}"
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except OSError as err:  # a cache folder it cannot write, a library it cannot load
        return None, f"{err} (set MINILLM_CACHE to a folder this user can write)"
    lib.matvec_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    lib.matvec_f32.restype = None
    return lib, ""


def matvec_status() -> tuple[bool, str]:
    """(the C kernel runs here, '' or the reason it cannot)."""
    lib, why = _library()
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
    lib = _library()[0]
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
