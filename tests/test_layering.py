"""The layering of DESIGN.md, checked on every module's imports (including imports by string).

| package | must not import |
|---|---|
| probes | analyses, app (not even through importlib with a string) |
| cache | probes, analyses, app, saes (only the leaves thoughtscope.errors and thoughtscope.checks) |
| saes | app |
| analyses | app, streamlit |
| thoughtscope.errors, thoughtscope.omp | anything of the project (leaf modules) |
| thoughtscope.provenance | probes, analyses, app, saes, cache, benchmarks, thoughtscope.cli |
| thoughtscope.checks | anything of the project but thoughtscope.errors (a leaf beside it) |
| everything but tests | thoughtscope.cli (the entry point sits above every package) |

And no import circle among the project's modules: the graph is built from every import statement
(function-local ones and importlib strings included), so a circle hidden inside a function fails too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("thoughtscope", "probes", "analyses", "app", "saes", "cache", "benchmarks")
RULES = {
    "probes": ("analyses", "app", "thoughtscope.cli"),
    "cache": ("probes", "analyses", "app", "saes", "thoughtscope.cli"),
    "saes": ("app", "thoughtscope.cli"),
    "analyses": ("app", "streamlit", "thoughtscope.cli"),
    "app": ("thoughtscope.cli",),
    "thoughtscope/errors.py": PROJECT,
    "thoughtscope/omp.py": PROJECT,
    "thoughtscope/checks.py": ("thoughtscope.cli", "thoughtscope.provenance", "thoughtscope.shipped", "probes",
                               "analyses", "app", "saes", "cache", "benchmarks"),
    "thoughtscope/provenance.py": ("probes", "analyses", "app", "saes", "cache", "benchmarks", "thoughtscope.cli"),
}
_MODULE_STRING = re.compile(r"^[a-z_]+(\.[a-z_0-9]+)+$")


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import statement, importlib/__import__ call and dotted module string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            found.append((node.lineno, node.value))
    return found


def banned(name: str, rules: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in rules)


def violations(path: Path, rules: tuple[str, ...]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in imported_names(tree)
            if banned(name, rules)]


def files_of(target: str) -> list[Path]:
    path = ROOT / target
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("target", sorted(RULES))
def test_no_import_against_the_layering(target):
    found = [v for f in files_of(target) for v in violations(f, RULES[target])]
    assert not found, "\n".join(found)


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """A checker that misses an import form would pass forever: each form is caught here."""
    sample = tmp_path / "sample.py"
    sample.write_text("import app.main\nfrom analyses import rise\nimport importlib\n"
                      "importlib.import_module('analyses.cot_entropy')\nx = 'just a sentence. Not a module'\n")
    tree = ast.parse(sample.read_text())
    names = [name for _, name in imported_names(tree)]
    assert "app.main" in names and "analyses" in names and "analyses.cot_entropy" in names
    assert [n for n in names if banned(n, ("analyses", "app"))] == ["app.main", "analyses", "analyses.rise",
                                                                     "analyses.cot_entropy"]


# ----------------------------------------------------------------------------- import circles


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PROJECT) -> dict[str, Path]:
    """{dotted module name: file} for every module of the project's packages (a package is its __init__)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` lies in: the longest dotted prefix that is a module (None: not ours)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def module_imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """{project module imported: first line} for one module: `import a.b`, `from a import b` (b a module
    or a name of a), relative imports, importlib/`__import__` strings and dotted module strings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            edges.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in modules else _resolve(base, modules), node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            add(_resolve(node.value, modules), node.lineno)
    return edges


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    return {module: module_imports(module, path, modules) for module, path in modules.items()}


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def describe_circle(circle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    """One circle as its modules and, for each arrow inside it, the file and line of the import."""
    arrows = [f"  {modules[a].relative_to(ROOT) if modules[a].is_relative_to(ROOT) else modules[a]}:{line} "
              f"{a} -> {b}" for a in circle for b, line in sorted(graph[a].items()) if b in circle]
    return f"import circle among {', '.join(circle)}:\n" + "\n".join(arrows)


def test_no_import_circle_among_project_modules():
    modules = project_modules()
    graph = import_graph(modules)
    circles = import_circles(graph)
    assert not circles, "\n".join(describe_circle(c, graph, modules) for c in circles)


def test_the_circle_finder_reports_every_circle_with_its_lines(tmp_path):
    """A hidden function-local import and an importlib string each close a circle; a package importing
    its own submodule, and a submodule importing a sibling through the package, do not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("import json\n\ndef f():\n    from pkg import b\n    return b\n")
    (pkg / "b.py").write_text("import pkg.a\n")
    (pkg / "c.py").write_text("import importlib\nM = importlib.import_module('pkg.sub.d')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from .. import c\nfrom pkg import a\n")
    modules = project_modules(tmp_path, ("pkg",))
    graph = import_graph(modules)
    assert graph["pkg.a"] == {"pkg.b": 4}
    assert graph["pkg.sub.d"] == {"pkg.c": 1, "pkg.a": 2}
    assert import_circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
    text = describe_circle(["pkg.a", "pkg.b"], graph, modules)
    assert text.splitlines()[0] == "import circle among pkg.a, pkg.b:"
    assert text.splitlines()[1].endswith("pkg/a.py:4 pkg.a -> pkg.b")
    assert text.splitlines()[2].endswith("pkg/b.py:1 pkg.b -> pkg.a")
