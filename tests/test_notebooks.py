"""Every notebook keeps its word, read as JSON (nbval runs them; nothing is executed here):

- it imports the course only from the installed package (`minillm`, and the learner's
  `exercises`), never from the repository's scripts, and leaves `sys.path` alone, so that
  `pip install -e .` is all a notebook needs;
- the names its prose calls by the notebook's own import aliases exist (`trt.build`; full
  paths and dotted names are checked by test_references.py);
- its committed outputs read well unrun, as GitHub and an untrusted Jupyter show them: no
  frozen progress bars, no widget reprs, no committed errors, no compiler log spam;
- it opens clean in JupyterLab (the kernelspec JupyterLab writes back);
- it says what the chapter builds at the start and bridges to the next chapter at the end.
"""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from helpers import FIGURE, resolve

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(DIR.glob("[0-9][0-9]_*.ipynb"))
ALIASED = re.compile(r"`(\w+)\.(\w+)")
GLOG = re.compile(r"^[WIE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.py:\d+\]", re.M)  # torch's logs
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


@cache
def cells(name: str) -> list[dict]:
    return json.loads(DIR.joinpath(name).read_text())["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def prose(name: str) -> str:
    return "\n".join(text(c) for c in cells(name) if c["cell_type"] == "markdown")


def module_aliases(name: str) -> dict[str, str]:
    """alias -> module, from the notebook's own imports of course modules (`from minillm.export
    import tensorrt as trt`, `import minillm.kernels.flash_prefill as fp`)."""
    code = "\n".join(text(c) for c in cells(name) if c["cell_type"] == "code")
    found = {}
    for pkg, names in re.findall(r"^\s*from (minillm[\w.]*) import ([^(\n]+)", code, re.M):
        for part in names.split("#")[0].split(","):
            target, _, alias = part.strip().partition(" as ")
            found[alias or target] = f"{pkg}.{target}"
    for module, alias in re.findall(r"^\s*import (minillm[\w.]*) as (\w+)", code, re.M):
        found[alias] = module
    return {a: m for a, m in found.items() if a and resolve(m) is not None}


NAMES = [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("name", NAMES)
def test_it_imports_the_course_from_the_installed_package(name):
    code = "\n".join(text(c) for c in cells(name) if c["cell_type"] == "code")
    scripts = re.findall(r"^\s*(?:from|import) benchmarks\b.*", code, re.M)
    assert not scripts, f"{name} imports the benchmark scripts (import minillm.bench): {scripts}"
    assert "sys.path" not in code, f"{name} edits sys.path: the editable install is enough"


@pytest.mark.parametrize("name", NAMES)
def test_the_names_its_prose_calls_by_alias_exist(name):
    """`trt.compare_backends`, where the notebook imported `... tensorrt as trt` (full paths
    and dotted `minillm.` names are test_references.py's)."""
    missing = []
    aliases = module_aliases(name)
    for alias, attr in set(ALIASED.findall(prose(name))):
        module = aliases.get(alias)
        if attr == "py":  # `model_runner.py`: a file name, not an attribute
            continue
        if (
            isinstance(resolve(module) if module else None, ModuleType)
            and resolve(f"{module}.{attr}") is None
        ):
            missing.append(f"{alias}.{attr} ({module})")
    assert not missing, f"{name}'s prose names symbols that do not exist: {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_read_well_unrun(name):
    for i, cell in enumerate(cells(name)):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            shown = "".join(out.get("text", "")) + "".join(data.get("text/plain", ""))
            where = f"{name} cell {i}"
            assert out.get("output_type") != "error", f"{where}: an error is committed"
            assert "application/vnd.jupyter.widget-view+json" not in data, f"{where}: a widget"
            assert not re.search(r"^(interactive|VBox|HBox)\(children=", shown), (
                f"{where}: a widget repr"
            )
            assert not re.search(r"\d+%\|[^\n]*\| *0/\d", shown), f"{where}: a frozen progress bar"
            assert not GLOG.search(shown), f"{where}: compiler log lines (quiet them in code)"


@pytest.mark.parametrize("name", NAMES)
def test_it_opens_clean_in_jupyterlab(name):
    metadata = json.loads(DIR.joinpath(name).read_text())["metadata"]
    assert metadata.get("kernelspec") == KERNELSPEC, f"{name}: save it with JupyterLab's kernelspec"


@pytest.mark.parametrize("name", NAMES)
def test_it_starts_with_a_plan_and_ends_with_a_bridge(name):
    markdown = [text(c).lower() for c in cells(name) if c["cell_type"] == "markdown"]
    opening = "\n".join(markdown[:3])
    assert re.search(r"you will|you'll|what you build|build and measure", opening), (
        f"{name}: its first cells should say what the chapter builds and measures"
    )
    closing = "\n".join(markdown[-3:])
    assert re.search(r"next|bridge|what is left|what's left|chapter \d\d", closing), (
        f"{name}: its last cells should say what problem is left for the next chapter"
    )


def _save_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("notebook_save", DIR / "save.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_a_generated_paragraph_reads_once(name):
    """A cell that writes prose from the run's numbers shows its output, the paragraph, with
    its source (the f-string: the same paragraph again, with code in it) hidden."""
    save = _save_module()
    shown = [
        i
        for i, cell in enumerate(cells(name))
        if save.renders_a_paragraph(cell)
        and not cell["metadata"].get("jupyter", {}).get("source_hidden")
    ]
    assert not shown, f"{name}: cells {shown} show a generated paragraph twice (run save.py)"


def test_paragraph_cells_are_found():
    save = _save_module()
    assert sum(save.renders_a_paragraph(c) for n in NAMES for c in cells(n)) >= 30


@pytest.mark.parametrize("name", NAMES)
def test_it_reads_in_at_most_5000_words(name):
    """Prose and outputs a learner reads top to bottom (save.reading_words: the code on top,
    collapsed <details> on demand): about 25 minutes, not an hour."""
    save = _save_module()
    words = save.reading_words(json.loads(DIR.joinpath(name).read_text()))
    assert words <= save.READING_WORDS, (
        f"{name} reads {words} words of prose and outputs, over {save.READING_WORDS}: move "
        "reference material to docs/ or a collapsed <details> block, print less"
    )


def test_reading_words_skip_code_and_collapsed_blocks():
    save = _save_module()
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": ["one two <details>three four</details> five"]},
            {
                "cell_type": "code",
                "source": ["not counted = 1"],
                "outputs": [
                    {"output_type": "stream", "text": ["six seven"]},
                    {
                        "output_type": "display_data",
                        "data": {"image/png": "...", "text/plain": ["<Figure>"]},
                    },
                    {"output_type": "execute_result", "data": {"text/plain": ["eight"]}},
                ],
            },
        ]
    }
    assert save.reading_words(nb) == 6


# A figure a notebook's static Markdown states must be in its outputs (so the run produced it),
# unless it is not a measurement: a setting, the article's own figure, or arithmetic. Those
# are listed here with why; anything else belongs in a cell that formats it from the run.
STATED: dict[str, dict[str, str]] = {
    "05": {"256 MiB": "the size of the buffer whose sum measures the read speed, a setting"},
}


def outputs_text(name: str) -> str:
    """Everything the committed run printed or displayed as text, one string."""
    chunks = []
    for cell in cells(name):
        for out in cell.get("outputs", []):
            chunks.append("".join(out.get("text", "")))
            chunks += ["".join(v) for k, v in out.get("data", {}).items() if k.startswith("text")]
    return "\n".join(chunks)


@pytest.mark.parametrize("name", NAMES)
def test_static_prose_states_only_figures_its_run_printed(name):
    shown = outputs_text(name)
    stated = STATED.get(name[:2], {})
    strays = []
    for cell in cells(name):
        if cell["cell_type"] == "markdown":
            for figure in FIGURE.findall(
                re.sub(r"<details>.*?</details>", "", text(cell), flags=re.S)
            ):
                if figure not in shown and figure not in stated:
                    strays.append(figure)
    assert not strays, (
        f"{name}'s Markdown states {strays}, which no output of its run shows: format them "
        "from the run in a display(Markdown(...)) cell, or list a setting or an article's "
        "figure in STATED with why"
    )


def test_source_details_shows_the_code_collapsed(monkeypatch):
    import IPython.display

    from minillm.lab.notebook import source_details

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    source_details("Going further: the source", source_details)
    block = shown[0].data
    assert block.startswith("<details><summary>Going further: the source</summary>")
    assert "def source_details(summary: str" in block and block.endswith("</details>")


def test_show_source_prints_the_code_without_its_docstring(capsys):
    from minillm.lab.notebook import show_source

    show_source(show_source)
    printed = capsys.readouterr().out
    assert printed.startswith("def show_source(") and "for fn in functions:" in printed
    assert "the lines that do the work" not in printed
