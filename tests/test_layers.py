"""The package's layering, checked from the source: a lower layer never imports a higher one, and no
two modules import each other (directly or in a circle) at import time."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.runs import ROOT

# lowest first; a module may import its own layer and the layers before it
LAYERS = [
    ("lit_minimind.errors",),
    ("lit_minimind.checkpoint",),  # the file format: bytes and schemas, no trainer
    ("lit_minimind.resume",),  # the seam with Lightning
    ("lit_minimind.data",),
    ("lit_minimind.model",),
    ("lit_minimind.callbacks",),
    ("lit_minimind.cli", "lit_minimind.fit", "lit_minimind.generate", "lit_minimind.inspect", "lit_minimind.export",
     "lit_minimind.precision", "lit_minimind"),  # entry points and the package's public names
]


def layer(module: str) -> int:
    """The layer of the longest prefix naming ``module`` or a package above it."""
    matches = [(len(p), index) for index, prefixes in enumerate(LAYERS) for p in prefixes
               if module == p or module.startswith(p + ".")]
    assert matches, f"{module} is in no layer of tests/test_layers.py"
    return max(matches)[1]


def modules() -> dict[str, Path]:
    found = {}
    for package in ("lit_minimind",):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    """Project modules ``path`` imports (``from a.b import c`` counts ``a.b.c`` when that is a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    known = modules()
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def test_no_module_imports_a_higher_layer() -> None:
    wrong = []
    for module, path in modules().items():
        for imported in imports(path, top_level_only=False):
            if layer(imported) > layer(module):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "layering broken:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles() -> None:
    graph = {m: imports(p, top_level_only=True) - {m} for m, p in modules().items()}
    for m in list(graph):  # importing a.b.c imports the packages a.b and a first: not a cycle of a's
        graph[m] = {i for i in graph[m] if not m.startswith(i + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layers_catch_a_violation(tmp_path: Path) -> None:
    """The check itself: a checkpoint module importing the CLI is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from lit_minimind.cli.fit import main\n")
    assert "lit_minimind.cli.fit" in imports(bad, top_level_only=True)
    assert layer("lit_minimind.cli.fit") > layer("lit_minimind.checkpoint.atomic")


def test_ruff_lint_is_clean() -> None:
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
