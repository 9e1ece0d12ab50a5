"""Which machine a measurement came from, recorded in every result file.

The same benchmark gives different ratios on different CPUs: int8 decode on torch's
weight-only kernel ran 1.17x fp32 on an AVX2 EPYC, 1.48-1.51x on a Zen 4 EPYC and 1.79x on
a third, AVX512 machine, all three with the same code (`benchmarks.quant_decode`). A
figure is only checkable with its machine beside it, and a cloud VM's CPU name alone
("AMD EPYC") does not tell them apart: its family and model numbers do (family 25 model
17 is Zen 4).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def cpuinfo_fields(cpuinfo: str | None = None) -> dict[str, str] | None:
    """The first core's `key: value` entries of `cpuinfo` (default /proc/cpuinfo: 'model
    name', 'flags', ...); None where there is no such file (macOS, Windows)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_name(cpuinfo: str | None = None) -> str:
    """'<model name> (family F model M)' from `cpuinfo` (default /proc/cpuinfo), or
    `platform.processor()` where there is no such file."""
    fields = cpuinfo_fields(cpuinfo)
    if fields is None:
        return platform.processor() or platform.machine()
    name = fields.get("model name") or fields.get("Processor") or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def machine_info(threads: int) -> dict[str, Any]:
    """The machine and settings a run measured on: OS, CPU, the instruction set torch's
    kernels use (AVX2, AVX512, ...), cores, the threads the run used, torch's version."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
    }
