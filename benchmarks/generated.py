"""A page's generated part, rewritten or checked (README's results table, CLAIMS.md's tables).

Standard library only: the generators' tests import it.
"""

from __future__ import annotations

import sys
from pathlib import Path


def rewrite(path: Path, new: str, what: str, command: str, check: bool) -> int:
    """Write `new` to `path`, or with `check` only say whether `path` already holds it: the
    exit status (1: `what` in `path` is stale, and `command` brings it up to date)."""
    old = path.read_text()
    if check:
        if new != old:
            print(f"{path.name}, {what}: out of date, run {command}", file=sys.stderr)
            return 1
        print(f"{path.name}, {what}: up to date")
        return 0
    if new != old:
        path.write_text(new)
    print(f"{path.name}, {what}: " + ("rewritten" if new != old else "already up to date"))
    return 0
