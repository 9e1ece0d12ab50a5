"""The package's architecture, checked: imports point down the layers, never up, never in
a circle, and no module grows past what one reading can hold.

Every `import minillm...` counts, including the ones inside functions: a lazy import is
still a dependency, and a lazy import that points up would only hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minillm"
# Lowest first. A module may import its own folder and the folders of lower rank.
LAYERS = [
    {"paths", "_version"},  # import nothing of minillm
    {"kernels", "lab", "course"},  # leaves: import nothing of minillm above
    {"cache"},
    {"model"},
    {"generation"},
    {"training"},
    {"quant"},
    {"export"},
    {"engine"},
    {"serving"},
    {"bench"},
    {"__init__", "__main__", "cli", "doctor"},  # the package's front door
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MAX_LINES = 350


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


_ALL_MODULES = {
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
}


def _imports(path: Path) -> set[str]:
    """The minillm modules (or packages) `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "minillm":  # `from minillm import x`: x a submodule or a name
                found |= {
                    f"minillm.{a.name}" if f"minillm.{a.name}" in _ALL_MODULES else "minillm"
                    for a in node.names
                }
            elif node.module.startswith("minillm."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("minillm.")}
    return found


def _layer(module: str) -> str:
    """'minillm.cache.paged' -> 'cache'; 'minillm.cli' -> 'cli'; 'minillm' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: {i for i in _imports(p) if i != m} for m, p in MODULES.items()}


def test_every_folder_has_a_layer() -> None:
    layers = {_layer(m) for m in MODULES}
    assert layers <= RANK.keys(), f"add {sorted(layers - RANK.keys())} to LAYERS"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    own = _layer(module)
    up = [
        i
        for i in GRAPH[module]
        if _layer(i) != own
        and RANK.get(_layer(i), len(LAYERS)) >= RANK[own]
        and not (own in {"__init__", "__main__", "cli", "doctor"} and _layer(i) in RANK)
    ]
    assert not up, f"{module} (layer {own!r}) imports from the same or a higher layer: {up}"


def test_leaves_import_nothing_of_minillm() -> None:
    for module in MODULES:
        if _layer(module) in LAYERS[0]:
            outside = [i for i in GRAPH[module] if _layer(i) != _layer(module)]
            assert not outside, f"{module} is a leaf but imports {outside}"


def test_no_import_cycles() -> None:
    """Depth-first search over module -> imported module; a back edge is a cycle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt not in MODULES:
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_fit_one_reading(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (> {MAX_LINES}): split it by job"


def test_the_package_never_imports_the_benchmark_scripts() -> None:
    """benchmarks/ is command lines over the package: the measurement code they run lives in
    minillm (`minillm.bench`), so `pip install -e .` gives a notebook all of it."""
    scripts = {
        module
        for module, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "benchmarks")
        or (
            isinstance(node, ast.Import)
            and any(a.name.split(".")[0] == "benchmarks" for a in node.names)
        )
    }
    assert not scripts, f"these modules import benchmarks/ (move what they need): {sorted(scripts)}"


def _root_name(node: ast.expr) -> str | None:
    """'F' for `F.scaled_dot_product_attention`, 'torch' for `torch.nn.functional.x`."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _targets(node: ast.expr) -> list[ast.expr]:
    """The assigned expressions of one target, tuples and lists unpacked."""
    if isinstance(node, ast.Tuple | ast.List):
        return [t for elt in node.elts for t in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return [node]


def _patches(path: Path) -> list[str]:
    """'file:line code' of each assignment to an attribute of an imported name (a module,
    or a class from one), and of each `setattr(<imported name>, ...)`, anywhere in `path`."""
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):  # `import torch.nn.functional` binds `torch`
            imported |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = _targets(node.target)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            # setattr(F, "scaled_dot_product_attention", ...): the object itself is the target
            targets = [node] if node.func.id == "setattr" else []
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Call):
                hit = _root_name(target.args[0]) in imported
            else:
                hit = isinstance(target, ast.Attribute) and _root_name(target) in imported
            if hit:
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                found.append((node.lineno, f"{where} {ast.unparse(target)}"))
    return [hit for _, hit in sorted(found)]


def test_nothing_patches_an_imported_module_or_class() -> None:
    """An exporter, a kernel or a quantizer that wants its own form of the model's norm,
    RoPE or attention asks for it through an extension point, instead of swapping a
    process-global function (`F.scaled_dot_product_attention = ...`) or a class's method
    (`transformer.RMSNorm.forward = ...`): while a patch is in place every other model,
    thread and test of the process runs it too. Instance attributes (`self.x = ...`) are
    the object's own business."""
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _patches(path)]
    assert not found, (
        "these lines assign to an attribute of an imported module or class:\n  "
        + "\n  ".join(found)
        + "\nuse an extension point instead: `with model.using(norm=..., rope=..., "
        "attention=...)` (minillm.model.transformer.Ops) for the model's ops, a cache's "
        "`sdpa` (minillm.cache.protocol.SdpaCache) for the attention over cached K/V"
    )
