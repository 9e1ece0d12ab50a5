"""Which way Triton kernels run is decided once, reported truthfully, and named when it
cannot work: the interpreter exactly when there is no CUDA."""

import os
import subprocess
import sys

import pytest

from minillm import kernels


def _status_in_fresh_process(env: dict[str, str], fake_no_cuda: bool) -> str:
    code = (
        "import torch\n"
        + ("torch.cuda.is_available = lambda: False\n" if fake_no_cuda else "")
        + "import os, minillm.kernels as k\n"
        "print(os.environ.get('TRITON_INTERPRET'), *k.triton_status(), sep='|')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_no_cuda_turns_the_interpreter_on_before_triton_is_imported():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert _status_in_fresh_process(env, fake_no_cuda=True) == "1|True|interpreter"


def test_an_explicit_setting_is_respected_and_reported():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = _status_in_fresh_process(env, fake_no_cuda=True)
    assert out.startswith("0|False|") and "TRITON_INTERPRET=0" in out


def test_cuda_with_the_interpreter_on_is_not_reported_as_cuda(monkeypatch):
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_status() == (True, "interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.triton_status() == (True, "cuda")


def test_require_triton_names_the_fix(monkeypatch):
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="unset it"):
        kernels.require_triton()
