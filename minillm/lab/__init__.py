"""Measuring tools the notebooks and benchmarks share: speed as ratios measured in one run,
exact tensor memory, where time goes, the roofline; plots in `minillm.lab.plots`.

A leaf of the package: it imports nothing else of minillm."""

from minillm.lab.machine import cpu_name, cpuinfo_fields, machine_info
from minillm.lab.memory import (
    format_bytes,
    peak_tensor_bytes,
    rss_bytes,
    saved_tensor_bytes,
    tensor_traffic,
    trace_tensor_memory,
)
from minillm.lab.profile import (
    Roofline,
    TimeSplit,
    count_flops,
    count_ops,
    kernel_shares,
    measure_roofline,
    ops_per_forward,
    profile_split,
)
from minillm.lab.timing import paired_ratios, time_interleaved, time_ratios, time_samples

__all__ = [
    "Roofline",
    "TimeSplit",
    "count_flops",
    "count_ops",
    "cpu_name",
    "cpuinfo_fields",
    "format_bytes",
    "kernel_shares",
    "machine_info",
    "measure_roofline",
    "ops_per_forward",
    "paired_ratios",
    "peak_tensor_bytes",
    "profile_split",
    "rss_bytes",
    "saved_tensor_bytes",
    "tensor_traffic",
    "time_interleaved",
    "time_ratios",
    "time_samples",
    "trace_tensor_memory",
]
