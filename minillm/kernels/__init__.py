"""Triton kernels of the course, each with a PyTorch reference it is tested against.

Triton needs a GPU, or its CPU interpreter: set `TRITON_INTERPRET=1` in the environment
*before* anything imports triton (the tests and notebooks do). `triton_status()` says which
of the two this process can use, and why not when neither.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_status() -> tuple[bool, str]:
    """(can run Triton kernels here, how: 'cuda', 'interpreter' or the reason it cannot)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton==3.7.1)"
    if torch.cuda.is_available():
        return True, "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "interpreter"
    return False, (
        "no CUDA device and TRITON_INTERPRET is not 1: set TRITON_INTERPRET=1 in the "
        "environment before Python starts (or before the first `import triton`) to run the "
        "kernels in Triton's CPU interpreter"
    )


def require_triton() -> str:
    """Raise a RuntimeError naming the fix unless Triton kernels can run; return the mode."""
    ok, how = triton_status()
    if not ok:
        raise RuntimeError(f"cannot run Triton kernels: {how}")
    return how
