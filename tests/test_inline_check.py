"""The notebooks' in-place grader: `exercises.check.check` runs an exercise's tests on the
learner's function and says pass, fail (with every failing check and its message) or not
yet.

It runs pytest inside the caller's process, so this test drives it in a fresh Python
(as a notebook kernel would) rather than nesting pytest in pytest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
from exercises.check import check
from solutions.ch02_kv_cache import kv_cache_bytes

def halved(config, tokens, batch, dtype):
    return kv_cache_bytes(config, tokens, batch, dtype) // 2

def todo(config, tokens, batch, dtype):
    raise NotImplementedError("ch02: implement kv_cache_bytes")

print("RESULT", bool(check("ch02.kv_cache_bytes", kv_cache_bytes)))
print("RESULT", bool(check("ch02.kv_cache_bytes", halved)))
print("RESULT", bool(check("ch02.kv_cache_bytes", todo)))
for bad in ("ch02.kv_cache_bites", "ch11.anything", "ch02"):
    try:
        check(bad, kv_cache_bytes)
    except ValueError as e:
        print("REFUSED", e)
"""


def test_check_passes_fails_and_says_not_yet():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINILLM_IMPL": "exercises"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT / "notebooks",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert [line for line in out.splitlines() if line.startswith("RESULT")] == [
        "RESULT True",
        "RESULT False",
        "RESULT False",
    ]
    assert "✓ ch02.kv_cache_bytes: all" in out
    failing = re.search(r"ch02.kv_cache_bytes: (\d+) of (\d+) checks fail:", out)
    assert failing, out
    listed = re.findall(r"^  ✗ (test_ch02_kv_cache_bytes\S*)$", out, re.M)
    assert len(listed) == int(failing.group(1)) > 1, (listed, failing.group(0))
    assert "got 65536 bytes" in out  # the failing assertion's own message, not a traceback
    assert "not yet: write the function's body" in out
    assert "Traceback" not in out
    assert out.count("REFUSED") == 3 and "has no function kv_cache_bites" in out
    assert "chapters with exercises" in out and "write chapter.exercise" in out
