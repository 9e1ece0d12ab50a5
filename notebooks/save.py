"""Run notebooks top to bottom and save them with outputs that read well unrun.

    python notebooks/save.py 02_kv_cache.ipynb [...]     # run, then tidy and save
    python notebooks/save.py --tidy-only 02_kv_cache.ipynb  # only tidy what is saved

A notebook opened on GitHub, or untrusted in Jupyter, shows its saved outputs as they are.
Executed by nbconvert, those carry what only a live kernel renders well: tqdm's widget bars
(saved as a widget reference that shows as raw text or "model not found"), text bars frozen
mid-way by carriage returns, and per-cell execution timestamps that turn every re-run into a
diff. `tidy` removes the first, keeps the last state of the second, drops the third and
writes the kernelspec JupyterLab writes back, so an opened notebook is not marked modified.
A cell that writes a paragraph from the run's numbers gets its source hidden, so the
paragraph reads once (its output), not twice (the f-string, then the text).
`reading_words` counts what a learner reads by default (prose and outputs, not code, not
what a collapsed <details> block holds); save.py prints it and `tests/test_notebooks.py`
checks it with the rest.

    python notebooks/save.py --words            # every notebook's reading length
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
WIDGET = "application/vnd.jupyter.widget-view+json"
BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+")  # a tqdm bar: "timing: 40%|####  | 2/5 [...]"


def _last_state(text: str) -> str:
    """A stream as a terminal leaves it: each line's text after its last carriage return,
    and no progress bar that did not reach its end (those are left by leave=False bars)."""
    kept = []
    for line in text.split("\n"):
        shown = line.split("\r")[-1]
        bar = BAR.search(shown)
        if bar and not re.search(r"(\d+)/\1\b", shown):
            continue
        if shown.strip() or not line:
            kept.append(shown)
    return "\n".join(kept)


# A paragraph written by the run: display(Markdown(f"..." ...)), the string maybe in parentheses
PARAGRAPH = re.compile(r"""display\(\s*Markdown\(\s*\(?\s*[fr]?["']""")


def renders_a_paragraph(cell: dict) -> bool:
    """A code cell that writes prose from the run's numbers (`display(Markdown(f\"\"\"...`):
    its output is the paragraph, so its source is hidden and the text shows once."""
    return cell["cell_type"] == "code" and bool(PARAGRAPH.search("".join(cell["source"])))


def tidy(nb: dict) -> dict:
    """The notebook with its outputs as they should be saved (see the module docstring)."""
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if renders_a_paragraph(cell):  # JupyterLab collapses it; a click shows the code
            cell.setdefault("metadata", {}).setdefault("jupyter", {})["source_hidden"] = True
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET in data and BAR.search("".join(data.get("text/plain", ""))):
                continue  # a tqdm widget: nothing to show without its kernel
            if out.get("output_type") == "stream":
                text = _last_state("".join(out["text"]))
                if not text.strip():
                    continue
                out["text"] = text
            outputs.append(out)
        if cell["cell_type"] == "code":
            cell["outputs"] = outputs
    nb["metadata"]["kernelspec"] = dict(KERNELSPEC)
    return nb


READING_WORDS = 5000  # a chapter's prose and outputs: about 25 minutes at 200 words a minute
DETAILS = re.compile(r"<details>.*?</details>", re.S)  # collapsed: read on demand
PICTURES = ("image/png", "image/svg+xml")  # their text/plain is only a stand-in


def reading_words(nb: dict) -> int:
    """Words a learner reads top to bottom: markdown cells and every cell's outputs (streams,
    Markdown, the plain text of a value that is not a picture), less what sits inside a
    collapsed <details> block (solutions, "going further"). The code is read on top."""
    chunks = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            chunks.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text" in out:
                chunks.append("".join(out["text"]))
            elif "text/markdown" in data:
                chunks.append("".join(data["text/markdown"]))
            elif "text/plain" in data and not any(k in data for k in PICTURES):
                chunks.append("".join(data["text/plain"]))
    return len(DETAILS.sub(" ", "\n".join(chunks)).split())


def write(nb: dict, path: Path) -> None:
    """The repository's notebook format: one-space indent, sorted keys, UTF-8 as is."""
    path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def run(path: Path, timeout: int) -> dict:
    """Execute `path` in its own folder with this Python's kernel; raises on a failing cell."""
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(path, as_version=4)
    ExecutePreprocessor(timeout=timeout, kernel_name="python3").preprocess(
        nb, {"metadata": {"path": str(path.parent)}}
    )
    return json.loads(nbformat.writes(nb))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="file names in notebooks/ or paths")
    parser.add_argument("--tidy-only", action="store_true", help="do not execute, only tidy")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell (900)")
    parser.add_argument("--words", action="store_true", help="print reading lengths only")
    args = parser.parse_args(argv)
    if args.words:
        for path in sorted(HERE.glob("[0-9][0-9]_*.ipynb")):
            print(f"{reading_words(json.loads(path.read_text())):6d}  {path.name}")
        return
    if not args.notebooks:
        parser.error("name the notebooks to run (or --words)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # notebooks never download by default
    for name in args.notebooks:
        path = Path(name) if Path(name).exists() else HERE / name
        if not path.exists():
            sys.exit(f"{name}: no such notebook (give a file in {HERE} or a path)")
        nb = json.loads(path.read_text()) if args.tidy_only else run(path, args.timeout)
        write(tidy(nb), path)
        words = reading_words(nb)
        print(f"saved {path.name}: {words} words of prose and outputs (at most {READING_WORDS})")


if __name__ == "__main__":
    main()
