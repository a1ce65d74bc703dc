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


def test_the_backend_sweeps_summary_compares_with_inductor_where_its_output_passes_the_check():
    """bench/kernelbench_backend.py's summary: geometric means over every timed problem, and against inductor over
    the problems where inductor's output passes KernelBench's check only (a TF32 call where eager's is fp32-level
    fails it: its time is not a bar kgen, matching eager, can be held to), naming the least of those."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from kernelbench_backend import summary
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def row(number, eager, inductor, kgen, inductor_check):
        return {"number": number, "eager_ms": eager, "inductor_ms": inductor, "kgen_ms": kgen, "partitions_kgen": 1,
                "kgen_check": "5/5 (max diff 0)", "inductor_check": inductor_check}

    rows = [row(1, 4.0, 2.0, 1.0, "5/5 (max diff 0)"), row(2, 4.0, 1.9, 2.0, "5/5 (max diff 1e-05)"),
            row(3, 4.0, 1.0, 2.0, "0/5 (max diff 0.0004)")]
    text = summary(rows)[0]
    assert "KernelBench's check passed by kgen on 3, by inductor on 2" in text
    assert "Against inductor where it passes the check (2): geometric mean 1.38x, the least 0.95x (2)." in text, text
    assert "Dynamo alone" not in text  # (rows timed before that column)
    rows[0]["dynamo_ms"], rows[1]["dynamo_ms"] = 1.1, 1.9  # kgen 1.0 and 2.0: faster on 1, slower on 2
    text = summary(rows)[0]
    assert text.endswith("Against Dynamo alone (2 rows with it): geometric mean 1.02x; slower on 2 (0.95x)."), text
