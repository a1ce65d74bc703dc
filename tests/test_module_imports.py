"""kgen's modules import on their own, in any order: each first in an interpreter that knows no kgen module, and
the import graph (every import statement, those under TYPE_CHECKING or inside functions included) has no cycle."""
import ast
import os
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = ROOT / "kgen"


def _modules() -> dict[str, object]:
    """Module name -> file, for every module of the package (walked, not listed)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "templates" in path.relative_to(PACKAGE).parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path) -> set[str]:
    """The kgen modules ``name`` imports. Importing ``a.b.c`` from outside ``a.b`` runs ``a.b``'s
    __init__ first, so that package counts too; a package's own submodules reach it for free."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            named.add(module)
            named.update(f"{module}.{a.name}" for a in node.names)  # `from kgen import plan`
    deps = set()
    for m in named:
        parts = m.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in MODULES and prefix != name and not (name + ".").startswith(prefix + "."):
                deps.add(prefix)
    return deps


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path a -> ... -> a, or None."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = "done"
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_walk_finds_the_package():
    assert {"kgen", "kgen.cli", "kgen.stage", "kgen.families", "kgen.families.base"} <= set(MODULES)


def test_the_cycle_check_names_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_has_no_cycle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert graph["kgen.stage"] >= {"kgen.buffer", "kgen.ir"}  # the parse sees relative imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# One fresh interpreter imports the third-party packages once, then for each kgen module forgets every kgen
# module imported so far and imports that one first (a fresh interpreter per module took a minute on 2 cores).
EACH_FIRST = """
import importlib, sys
import torch, jinja2, yaml, click  # third-party packages once: they cannot take part in a kgen circle
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "kgen" or n.startswith("kgen.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as e:
        print(f"{module}: {type(e).__name__}: {e}")
"""


def _each_first(modules, root) -> str:
    proc = subprocess.run([sys.executable, "-c", EACH_FIRST, *modules], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_every_module_imports_on_its_own():
    modules = sorted(m for m in MODULES if not m.endswith(".__main__"))  # __main__ runs the CLI
    assert len(modules) > 30 and "kgen.families.conv_aten" in modules
    failures = _each_first(modules, ROOT)
    assert not failures, failures


def test_importing_each_first_finds_a_circle(tmp_path):
    """The check above fails where a module cannot be imported first: two modules that import each other at
    the top, each reading a name the other defines below its import."""
    pkg = tmp_path / "kgen"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kgen.b import B\nA = 1\n")
    (pkg / "b.py").write_text("from kgen.a import A\nB = 2\n")
    out = _each_first(["kgen.a", "kgen.b"], tmp_path)
    assert "kgen.a: ImportError" in out and "kgen.b: ImportError" in out, out
