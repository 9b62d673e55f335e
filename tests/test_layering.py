"""The layering of DESIGN.md, checked on every module's imports (including imports by string).

| package | must not import |
|---|---|
| probes | analyses, app (not even through importlib with a string) |
| cache | probes, analyses, app, saes (only the leaf thoughtscope.errors) |
| saes | app |
| analyses | app, streamlit |
| thoughtscope.errors, thoughtscope.provenance | anything of the project (leaf modules) |
| thoughtscope.checks | anything of the project but thoughtscope.errors (a leaf beside it) |
| everything but tests | thoughtscope.cli (the entry point sits above every package) |
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
