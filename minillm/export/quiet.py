"""Silence the ONNX exporter and ONNX Runtime's tools: their progress prints, their log
lines and the warnings known to be harmless, down to the C++ code's own writes."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the exporter's (and ORT tools') progress prints and known-harmless warnings."""
    names = ("", "torch", "torch.onnx", "torch.export", "torch.fx", "torch._dynamo", "onnxscript")
    names += ("onnxruntime",)  # "": the root logger
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    # C++ code (the legacy exporter dumps its whole TorchScript graph on failure) writes
    # to file descriptors 1 and 2 directly, holding the GIL: in Jupyter, whose kernel
    # reads those through a pipe in a Python thread, ~64 KB of it deadlocks. /dev/null.
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
