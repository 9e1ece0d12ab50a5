"""Triton kernels of the course, each with a PyTorch reference it is tested against.

Triton compiles for a GPU; on a machine without CUDA it can run the same kernels in its
CPU interpreter (slowly, for correctness only). Which one applies is decided here, once,
before any kernel module is imported (Triton reads `TRITON_INTERPRET` when a `@triton.jit`
function is defined): the interpreter exactly when there is no CUDA. An explicit
`TRITON_INTERPRET` in the environment is respected, and `triton_status()` reports what
really runs, so a GPU run with the interpreter on is never mistaken for a compiled one.
"""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_status() -> tuple[bool, str]:
    """(can run Triton kernels here, how: 'cuda', 'interpreter' or the reason it cannot)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton==3.7.1)"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.cuda.is_available() and not interpret:
        return True, "cuda"
    if interpret:
        return True, "interpreter"
    return False, (
        "no CUDA device and TRITON_INTERPRET=0 in the environment: unset it (or set it to 1) "
        "before Python starts to run the kernels in Triton's CPU interpreter"
    )


def require_triton() -> str:
    """Raise a RuntimeError naming the fix unless Triton kernels can run; return the mode."""
    ok, how = triton_status()
    if not ok:
        raise RuntimeError(f"cannot run Triton kernels: {how}")
    return how
