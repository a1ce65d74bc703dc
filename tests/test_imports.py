"""Every kgen module imports on its own, first: no import circle depends on the order in which a user's code
happens to import them. One fresh interpreter imports torch and the other third-party packages once, then for
each kgen module forgets every kgen module imported so far and imports that one first."""
import os
import subprocess
import sys

from conftest import ROOT

MODULES = sorted(
    "kgen." + str(p.relative_to(ROOT / "kgen").with_suffix("")).replace(os.sep, ".").removesuffix(".__init__")
    for p in (ROOT / "kgen").rglob("*.py")
    if p.name != "__main__.py" and "templates" not in p.parts  # (__main__ runs the command line)
)

EACH_FIRST = """
import importlib, sys, traceback
import torch, jinja2, yaml, click  # third-party packages once: they cannot take part in a kgen circle
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "kgen" or n.startswith("kgen.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as e:
        print(f"{module}: {type(e).__name__}: {e}")
"""


def test_every_module_imports_on_its_own():
    assert len(MODULES) > 30 and "kgen.families.conv_aten" in MODULES and "kgen.stage" in MODULES
    proc = subprocess.run([sys.executable, "-c", EACH_FIRST, *MODULES], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert not proc.stdout.strip(), proc.stdout


def test_a_circle_is_found():
    """The check above fails where a module cannot be imported first (a package whose modules import each other
    at the top, one of them reading a name the other defines below its import)."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        pkg = Path(d) / "kgen"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "a.py").write_text("from kgen.b import B\nA = 1\n")
        (pkg / "b.py").write_text("from kgen.a import A\nB = 2\n")
        proc = subprocess.run([sys.executable, "-c", EACH_FIRST, "kgen.a", "kgen.b"], cwd=d, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=d))
    assert proc.returncode == 0, proc.stderr
    assert "kgen.a: ImportError" in proc.stdout and "kgen.b: ImportError" in proc.stdout, proc.stdout
