"""`make colab-check`: run notebooks as a fresh Colab runtime would, first cell included.

Why: each notebook's first cell is the only install a Colab learner gets, and `make test`
cannot tell whether it is enough, since .venv holds everything. This script builds a bare
runtime instead: a new virtual environment with only what Colab ships (minillm/course.py's
COLAB_SHIPPED; torch as the CPU build, triton beside it as Colab's CUDA torch brings it),
nbclient and ipykernel to run the notebook, and an empty `google.colab` module imported at
start-up, as on Colab. The "GitHub" the first cell clones is a local git repository holding
this working tree as one commit (uncommitted edits are what is checked), its URL put into
the cell's REPO_URL form field. Then each notebook runs in its own copy of that venv, top to
bottom on the CPU, its first cell as written, and one line per notebook says pass or fail
and the seconds it took.

    python tests/colab_check.py [06 08 ...] [--first-cell] [--keep]

--first-cell stops each notebook after its first cell and an `import minillm`: the set-up
alone, in a few minutes. The script itself needs only the standard library; inside the new
environment it runs again (--inside) to drive nbclient.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
REPO_URL = re.compile(r'^(REPO_URL = )"[^"]*"', re.M)
IMPORT_CHECK = "import minillm\n\nprint('import minillm:', minillm.__version__, minillm.__file__)"
# As `make test` runs notebooks: the reference solutions in the exercise cells, and no
# downloads (a notebook that needs one should fail here, not quietly fetch it).
NOTEBOOK_ENV = {"MINILLM_IMPL": "solutions", "HF_HUB_OFFLINE": "1"}


def load_course() -> ModuleType:
    """minillm/course.py by file path: it is standard library only, so this needs no minillm."""
    spec = importlib.util.spec_from_file_location("course", REPO / "minillm" / "course.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(command: list[str]) -> None:
    """Run a command, or exit naming it (its own output, above, says why)."""
    if subprocess.run(command).returncode:
        sys.exit(f"colab-check: this failed, see its output above: {' '.join(command)}")


def snapshot(dest: Path) -> str:
    """A git repository holding the working tree (tracked files and untracked ones git does
    not ignore) as one commit; its file:// URL, which `git clone --depth 1` accepts."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a file deleted from the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    git = ["git", "-C", str(dest), "-c", "user.name=colab-check", "-c", "user.email=c@c"]
    run(["git", "init", "-q", str(dest)])
    run([*git, "add", "-A"])
    run([*git, "commit", "-q", "-m", "the working tree, for colab-check"])
    return dest.as_uri()


def venv_python(python: Path, code: str) -> str:
    """What `code` prints in the venv's python."""
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def colab_venv(dest: Path, course: ModuleType, torch_index: str | None) -> Path:
    """A venv with what Colab ships and nothing of the course; its python."""
    run([sys.executable, "-m", "venv", str(dest)])
    python = dest / "bin" / "python"
    pins = course.pins(REPO / "requirements.txt")
    pip = [str(python), "-m", "pip", "install", "-q"]
    # torch first and alone (as `make venv` does), so nothing else can pull another build
    run([*pip, pins["torch"], *(["--index-url", torch_index] if torch_index else [])])
    shipped = sorted((course.COLAB_SHIPPED - {"torch"}) | {"triton", "nbclient", "ipykernel"})
    run([*pip, *(pins.get(course.normalize(name), name) for name in shipped)])
    purelib = venv_python(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    stub = Path(purelib) / "google" / "colab"  # `google` stays a namespace (protobuf's too)
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('"""colab-check\'s stand-in for Colab\'s module."""\n')
    # Colab's kernel has google.colab imported before the first cell: so does this one.
    (Path(purelib) / "colab_check_stub.pth").write_text("import google.colab\n")
    return python


def fresh_runtime(base: Path, dest: Path) -> Path:
    """A copy of the base venv for one notebook, as each Colab notebook gets its own runtime:
    hard links, so it takes seconds (pip replaces files, never writes into one)."""
    shutil.copytree(base, dest, symlinks=True, copy_function=os.link)
    return dest / "bin" / "python"


def notebook_path(number: str) -> Path:
    found = sorted((REPO / "notebooks").glob(f"{int(number):02d}_*.ipynb"))
    if not found:
        sys.exit(f"colab-check: no notebook {number} in notebooks/ (give numbers like 06 08)")
    return found[0]


def inside(notebook: Path, workdir: Path, url: str, first_cell: bool, timeout: int) -> int:
    """In the Colab-like venv: execute the notebook with nbclient; print one JSON line."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    setup_cell = code[0]
    setup_cell.source, found = REPO_URL.subn(rf'\1"{url}"', setup_cell.source)
    if found != 1:
        sys.exit(f'colab-check: {notebook.name}\'s first code cell has no REPO_URL = "..." line')
    if first_cell:
        nb.cells = [setup_cell, nbformat.v4.new_code_cell(IMPORT_CHECK)]
    os.environ.update(NOTEBOOK_ENV)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    started = time.perf_counter()
    setup_s = None
    error = None
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
                if cell is setup_cell:
                    setup_s = time.perf_counter() - started
    except CellExecutionError as err:
        error = str(err).strip().splitlines()[-1]
    shown = nb.cells if first_cell else [setup_cell]  # the set-up's output (and the import's)
    outputs = "".join(  # stdout: pip's warnings on stderr would crowd out set-up's lines
        o.get("text", "") for c in shown for o in c.get("outputs", []) if o.get("name") == "stdout"
    )
    result = {
        "notebook": notebook.name,
        "ok": error is None,
        "seconds": round(time.perf_counter() - started, 1),
        "first_cell_seconds": None if setup_s is None else round(setup_s, 1),
        "error": error,
        "first_cells_output": outputs[-4000:],
    }
    print("COLAB-CHECK " + json.dumps(result))
    return 0 if error is None else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python tests/colab_check.py", description=__doc__)
    parser.add_argument("notebooks", nargs="*", default=["06", "08"], help="default: 06 08")
    parser.add_argument(
        "--first-cell", action="store_true", help="only the first cell and `import minillm`"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    parser.add_argument(
        "--torch-index",
        help="where the CPU torch comes from (e.g. https://download.pytorch.org/whl/cpu; "
        "default: pip's own configuration)",
    )
    parser.add_argument(
        "--inside", nargs=3, metavar=("NOTEBOOK", "WORKDIR", "URL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.inside:
        notebook, workdir, url = args.inside
        return inside(Path(notebook), Path(workdir), url, args.first_cell, args.timeout)

    paths = [notebook_path(n) for n in args.notebooks]  # fail before building anything
    tmp = Path(tempfile.mkdtemp(prefix="colab-check-"))
    try:
        t0 = time.perf_counter()
        url = snapshot(tmp / "remote")
        base = colab_venv(tmp / "venv", load_course(), args.torch_index)
        torch = venv_python(
            base, "from importlib import metadata; print(metadata.version('torch'))"
        )
        print(f"colab-check: a Colab-like venv (torch {torch}) in {time.perf_counter() - t0:.0f} s")
        failed = 0
        for path in paths:
            python = fresh_runtime(tmp / "venv", tmp / f"runtime-{path.name[:2]}")
            workdir = tmp / f"content-{path.name[:2]}"  # Colab's /content
            workdir.mkdir()
            command = [str(python), __file__, "--inside", str(path), str(workdir), url]
            command += ["--timeout", str(args.timeout)] + ["--first-cell"] * args.first_cell
            out = subprocess.run(command, capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("COLAB-CHECK ")]
            if not lines:
                print(f"FAIL {path.name}: the runner stopped ({out.returncode}):\n{out.stderr}")
                failed += 1
                continue
            r = json.loads(lines[-1].removeprefix("COLAB-CHECK "))
            failed += not r["ok"]
            print(
                f"{'PASS' if r['ok'] else 'FAIL'} {r['notebook']}: {r['seconds']:.0f} s "
                f"(first cell {r['first_cell_seconds']} s)"
                + (f": {r['error']}" if r["error"] else "")
            )
            if not r["ok"] or args.first_cell:
                printed = (ln.rsplit("\r", 1)[-1] for ln in r["first_cells_output"].split("\n"))
                print("  its first cells printed:\n    " + "\n    ".join(printed))
        return int(failed > 0)
    finally:
        if args.keep:
            print(f"colab-check: kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
