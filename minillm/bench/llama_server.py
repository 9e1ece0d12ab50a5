"""Where llama.cpp's C++ `llama-server` is and how to start it (chapter 08's batching CPU
peer): `find_binary`, `command`, `start`. `python -m benchmarks.llama_server` builds it,
once, from the llama.cpp sources vendored in llama-cpp-python's sdist (`BUILD_COMMAND`).

The binary lives in `$MINILLM_CACHE/llama-server-<version>/build/bin/` (default
`~/.cache/minillm/`); `$LLAMA_SERVER` overrides where the benchmark and the tests look.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from minillm.bench.http_load import wait_until_up
from minillm.paths import cache_root

VERSION = "0.3.36"  # llama-cpp-python, as pyproject.toml's `llama` extra pins it
BUILD_COMMAND = "python -m benchmarks.llama_server"


def cache_dir() -> Path:
    """Where the sdist, sources and build live (`$MINILLM_CACHE`, default ~/.cache/minillm)."""
    return cache_root() / f"llama-server-{VERSION}"


def binary_path() -> Path:
    """The `llama-server` binary: `$LLAMA_SERVER` if set, else where the build puts it.
    The path may not exist yet; `find_binary` checks."""
    if os.environ.get("LLAMA_SERVER"):
        return Path(os.environ["LLAMA_SERVER"])
    return cache_dir() / "build" / "bin" / "llama-server"


def find_binary() -> Path | None:
    """The built binary, or None when it is absent (then: `python -m benchmarks.llama_server`)."""
    path = binary_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def command(
    gguf: Path,
    port: int,
    parallel: int,
    threads: int = 1,
    kv_cache: str = "f32",
    ctx_per_slot: int = 256,
) -> list[str]:
    """The `llama-server` command line `start` runs.

    `--parallel N` slots share one KV cache of `-c` tokens, `ctx_per_slot` each (the cache is
    split per slot when N is given). `kv_cache` "f32" computes what minillm computes;
    llama.cpp's default is "f16". Prompt caching is off (`--no-cache-prompt`, `--cache-ram
    0`): a benchmark that sends the same requests every round would otherwise measure cache
    hits (minillm's prefix cache is turned off for the same reason)."""
    path = find_binary()
    if path is None:
        raise SystemExit(f"llama-server is not built ({binary_path()}): run {BUILD_COMMAND}")
    return [
        str(path),
        *("--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("--parallel", str(parallel), "--ctx-size", str(ctx_per_slot * parallel)),
        *("--threads", str(threads), "--threads-batch", str(threads)),
        *("--cache-type-k", kv_cache, "--cache-type-v", kv_cache),
        *("--no-cache-prompt", "--cache-ram", "0"),
    ]


def start(gguf: Path, port: int, parallel: int, **options: Any) -> subprocess.Popen:
    """`llama-server` (see `command` for the options) on 127.0.0.1:port; returns once
    /health answers 200 (the model is loaded). Its log goes to `llama-server.log` in the
    cache directory (the last start's: read it when a start fails)."""
    cmd = command(gguf, port, parallel, **options)
    log = cache_dir() / "llama-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    what = f"llama-server (log: {log})"
    return wait_until_up(proc, f"http://127.0.0.1:{port}/health", what)
