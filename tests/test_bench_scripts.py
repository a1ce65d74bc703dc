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


def test_a_measurements_commit_says_when_the_tree_is_not_the_commits(tmp_path, monkeypatch):
    """A report names the commit it measured; a working tree that differs from it is marked ``-dirty``."""
    from kgen.bench import _commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-qm", "one")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KGEN_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert _commit() == head
    (tmp_path / "a.txt").write_text("2")
    assert _commit() == f"{head}-dirty"
