"""Every script under bench/ answers --help with its usage and what it does, without a GPU or the
KernelBench files (its imports resolve against the current kgen)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_script_answers_help(script):
    p = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage:") and len(p.stdout.splitlines()) > 3, p.stdout
