"""kgen as users install it: a wheel in a fresh virtual environment, used from a
directory that is not the repository (templates ship inside the package)."""
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

SPEC = """
name: wheel_check
input: {shape: [N, 3, 8, 8], example: {N: 2}}
ops:
  - conv2d: {out_channels: 4, kernel_size: 3}
  - relu
  - max_pool2d: {kernel_size: 2}
  - sum: {dim: 1}
"""


def _run(cmd, cwd, env=None):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _see_running_packages(python):
    """torch, jinja2, ... come from the interpreter running the tests: a .pth file in the new venv lists
    its site-packages. (`venv --system-site-packages` would expose the base interpreter's packages, which
    inside a virtual environment are not the ones the tests run with.) Only plain path lines: the .pth
    files of those folders (an editable kgen among them) are not processed, so kgen is the wheel's."""
    ours = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    theirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    theirs = [p for p in theirs if os.path.isdir(p)]
    Path(ours, "_running_interpreter.pth").write_text("".join(p + "\n" for p in theirs))


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_renders_builds_and_validates(tmp_path):
    # build from a copy, so the checkout gets no build/ or egg-info
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "_build", "_variants", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "--disable-pip-version-check",
          str(src), "-w", tmp_path / "wheels"], cwd=tmp_path)
    (wheel,) = (tmp_path / "wheels").glob("kgen-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    python, kgen = venv / "bin" / "python", venv / "bin" / "kgen"
    _see_running_packages(python)
    # --ignore-installed: a kgen installed in the system (e.g. editable) must not count as this one
    _run([python, "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", "--disable-pip-version-check", wheel], cwd=tmp_path)

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "wheel_check.yaml").write_text(SPEC)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("KGEN_")}
    where = _run([python, "-I", "-c", "import kgen, kgen.render as r; print(kgen.__file__); print(r.TEMPLATES)"], work, env)
    assert all(Path(line).resolve().is_relative_to(venv.resolve()) for line in where.split()), where

    _run([kgen, "render", "wheel_check.yaml", "--out", "out"], work, env)
    for f in ("__init__.py", "kgen_math.h", "kgen_runtime.h", "wheel_check/__init__.py", "wheel_check/binding.cpp"):
        assert (work / "out" / f).is_file(), f
    _run([kgen, "build", "--out", "out", "--device", "cpu"], work, env)
    table = _run([kgen, "validate", "--out", "out", "--device", "cpu"], work, env)
    assert next(l for l in table.splitlines() if l.startswith("wheel_check")).rstrip().endswith("ok"), table
    shape = _run([python, "-c", "import torch, out.wheel_check as m; print(tuple(m.Model()(torch.randn(2, 3, 8, 8)).shape))"],
                 work, env)
    assert shape.strip() == "(2, 3, 3)"
