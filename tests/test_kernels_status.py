"""Triton's availability check names the fix instead of failing deep inside a launch."""

import pytest

from minillm import kernels


def test_triton_status_names_the_fix_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = kernels.triton_status()
    assert not ok and "TRITON_INTERPRET=1" in why
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.require_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_status() == (True, "interpreter")
