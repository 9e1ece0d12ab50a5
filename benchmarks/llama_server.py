"""Build llama.cpp's C++ `llama-server` (CPU only) from the sources vendored in
llama-cpp-python's sdist, and say where the binary is (chapter 08's batching CPU peer).

    python -m benchmarks.llama_server            # build once (~12 min on 2 shared cores)
    python -m benchmarks.llama_server --where    # print the path if built, else exit 1
    llama-server --model bundled.gguf --parallel 8 --ctx-size 2048 --threads 1 \
        --threads-batch 1 --cache-type-k f32 --cache-type-v f32 --no-cache-prompt \
        --cache-ram 0 --port 8002   # what `minillm.bench.llama_server.start(gguf, 8002, 8)` runs

Why this and not `pip install llama-cpp-python`: the pip package builds llama.cpp as a
library and serves it from Python (`python -m llama_cpp.server`), one request at a time.
llama.cpp's own server, `llama-server --parallel N`, batches N requests per step
(continuous batching over N slots): the engine `minillm serve` should be compared with.
The sdist carries the full llama.cpp tree (`vendor/llama.cpp`) at the version the pip
package pins, so both peers are the same llama.cpp and nothing is fetched but the sdist
from PyPI.

What the build turns off, so that it needs no network and compiles only what the server
links: tests, examples, the web UI (its prebuilt assets would be downloaded from a
Hugging Face bucket at build time; the HTTP API does not need them), OpenSSL (HTTPS
model downloads; this llama.cpp has no CURL any more: `LLAMA_CURL` only warns). Release,
static libraries, `GGML_NATIVE` (llama.cpp's default: code for this CPU's instruction set,
as pip's build also gets), `nice -n 19`, `-j2`. The server target still compiles the
libraries it links (ggml, llama, common, the multimodal `mtmd`).

Idempotent: the sdist, the extracted tree and the CMake build directory live in
`$MINILLM_CACHE/llama-server-<version>/` (default `~/.cache/minillm/`); a second run finds
the binary and returns at once. `--rebuild` reruns CMake's (incremental) build.
`$LLAMA_SERVER` overrides where the benchmark and the tests look for the binary.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from minillm.bench.llama_server import BUILD_COMMAND, VERSION, binary_path, cache_dir, find_binary

CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",  # the web UI needs npm ...
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # ... or a download from a Hugging Face bucket
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS: models are local files here
    "-DGGML_NATIVE=ON",
    "-DGGML_CCACHE=OFF",
]


def run_command(cmd: list[str], **kwargs: Any) -> None:
    """Run `cmd`, echoed first; fail on a non-zero exit."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def sources(cache: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded and extracted once."""
    src = cache / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        run_command(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + [f"llama-cpp-python=={VERSION}", "-d", str(cache)]
        )
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    tmp = cache / "extracting"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise RuntimeError(f"{sdist} has no {prefix}: not the sdist this build expects")
        tar.extractall(tmp, members=members, filter="data")
    (tmp / prefix).rename(src)
    shutil.rmtree(tmp)
    return src


def build(rebuild: bool = False, jobs: int = 2) -> Path:
    """Download, configure and build `llama-server` unless it is already built; its path."""
    if os.environ.get("LLAMA_SERVER"):
        if find_binary() is None:
            raise SystemExit(f"$LLAMA_SERVER={binary_path()} is not an executable file")
        return binary_path()
    if not rebuild and find_binary() is not None:
        return binary_path()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: install CMake >= 3.14 and a C++17 compiler")
    cache = cache_dir()
    src = sources(cache)
    build_dir = cache / "build"
    start = time.perf_counter()
    if not (build_dir / "CMakeCache.txt").is_file():
        run_command(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_OPTIONS])
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    run_command(
        nice + ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]
    )
    minutes = (time.perf_counter() - start) / 60
    print(f"configured and built in {minutes:.1f} min", flush=True)
    if find_binary() is None:
        raise RuntimeError(f"the build finished but {binary_path()} is missing")
    return binary_path()


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = report.parser(__doc__)
    ap.add_argument("--where", action="store_true", help="print the path only if built")
    ap.add_argument("--rebuild", action="store_true", help="rerun the (incremental) build")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    args = ap.parse_args(argv)
    if args.where:  # the path alone, for `$(python -m benchmarks.llama_server --where)`
        path = find_binary()
        if path is None:
            raise SystemExit(f"llama-server is not built ({binary_path()}): run {BUILD_COMMAND}")
        print(path)
        return None
    run = report.start("llama-server-build", args)
    path = build(args.rebuild, args.jobs)
    print(path)
    return run.finish({"binary": str(path), "version": VERSION}, f"{path} (llama.cpp {VERSION})")


if __name__ == "__main__":
    main()
