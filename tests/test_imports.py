"""Every kgen module imports on its own, first, in a fresh interpreter: no import circle depends on the order
in which a user's code happens to import them."""
import concurrent.futures as cf
import os
import subprocess
import sys

from conftest import ROOT

MODULES = sorted(
    "kgen." + str(p.relative_to(ROOT / "kgen").with_suffix("")).replace(os.sep, ".").removesuffix(".__init__")
    for p in (ROOT / "kgen").rglob("*.py")
    if p.name != "__main__.py" and "templates" not in p.parts  # (__main__ runs the command line)
)


def _imports(module: str) -> str | None:
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return None if proc.returncode == 0 else f"{module}: {proc.stderr.strip().splitlines()[-1]}"


def test_every_module_imports_on_its_own():
    assert len(MODULES) > 30 and "kgen.families.conv_aten" in MODULES and "kgen.stage" in MODULES
    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        failures = [f for f in pool.map(_imports, MODULES) if f]
    assert not failures, "\n".join(failures)
