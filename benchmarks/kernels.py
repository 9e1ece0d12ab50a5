"""The course's Triton kernels against their references: error and speed.

    python -m benchmarks.kernels [--small] [--threads N] [--json out.json]

Paged decode attention and flash prefill (chapter 07) and the fused INT4 dequant-matmul
(chapter 06), each against its reference (`minillm.bench.kernels` says at which shapes).

On a GPU the kernels run compiled, in bf16, at real shapes; `--small` (and any CPU) runs
tiny fp32 shapes in Triton's interpreter: the same code paths, checked for correctness,
timings meaningless. One JSON line per row (`minillm.bench.kernels.run`), then one
`SUMMARY kernels:` line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from benchmarks import report
from minillm.bench import kernels

PARTS = ("paged_decode", "flash_prefill", "int4_matmul")


def _best(rows: list[dict], key: str, pick: Callable = max) -> float:
    """`pick` of `key` over the rows that ran (a row that failed has an error instead)."""
    return pick((r[key] for r in rows if key in r), default=math.nan)


def summary(result: dict[str, Any]) -> str:
    """Each kernel's worst error and best speed, against its reference."""
    paged, flash, int4 = (result[part] for part in PARTS)
    shapes = "tiny shapes, interpreted: timings meaningless" if result["small"] else "real shapes"
    return (
        f"{result['device']} ({shapes}), copy {result['copy_GBps']:.0f} GB/s; paged decode "
        f"max err {_best(paged, 'max_err'):.1e}, best {_best(paged, 'frac_of_copy'):.0%} of "
        f"copy bandwidth; flash prefill max err {_best(flash, 'max_err'):.1e}, best "
        f"{_best(flash, 'time_vs_sdpa', min):.2f}x SDPA flash's time; int4 matmul max rel err "
        f"{_best(int4, 'rel_err'):.1e}, best {_best(int4, 'speedup_vs_dense'):.2f}x bf16"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__)
    ap.add_argument("--small", action="store_true", help="tiny shapes (any machine)")
    args = ap.parse_args(argv)
    run = report.start("kernels", args)
    result = kernels.run(small=args.small or None)
    print(f"device {result['device']}, copy bandwidth {result['copy_GBps']:.0f} GB/s")
    for name in PARTS:
        for row in result[name]:
            print(
                json.dumps(
                    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                )
            )
    return run.finish(result, summary(result))


if __name__ == "__main__":
    main()
