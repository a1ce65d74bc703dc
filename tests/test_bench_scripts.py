"""Every script under bench/ answers --help with its usage and what it does, without a GPU or the
KernelBench files (its imports resolve against the current kgen)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))

# Runs each script given as __main__ with --help, one after another in this one process (each script's own
# process would import torch again: 5 s a script); writes {script: [exit status, stdout, stderr]} as JSON.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
out, scripts = sys.argv[1], sys.argv[2:]
results, path = {}, list(sys.path)
for script in scripts:
    sys.argv, sys.path[:] = [script, "--help"], path
    stdout, stderr, rc = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
    results[script] = [rc, stdout.getvalue(), stderr.getvalue()]
with open(out, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def help_outputs(tmp_path_factory):
    """script path -> (exit status, stdout, stderr) of ``script --help``."""
    out = tmp_path_factory.mktemp("bench_help") / "help.json"
    p = subprocess.run([sys.executable, "-c", HELP_DRIVER, str(out), *map(str, SCRIPTS)], capture_output=True, text=True,
                       cwd=ROOT, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_script_answers_help(script, help_outputs):
    rc, stdout, stderr = help_outputs[str(script)]
    assert rc == 0, stderr[-2000:]
    assert stdout.startswith("usage:") and len(stdout.splitlines()) > 3, stdout


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
