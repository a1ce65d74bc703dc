"""The README's worked example: a new spec written from the README alone renders,
builds and validates with no code change; and CI runs the README's test command."""
import re
import subprocess
import sys

from conftest import ROOT

README = (ROOT / "README.md").read_text()


def _example_spec() -> str:
    m = re.search(r"<!-- example-spec.*?-->\s*```yaml\n(.*?)```\s*<!-- end-example-spec -->", README, re.S)
    assert m, "README lost its example spec block"
    return m.group(1)


def test_readme_example_spec_renders_builds_and_validates(tmp_path):
    spec = tmp_path / "my specs" / "my pool pipeline.yaml"  # a path with spaces
    spec.parent.mkdir()
    spec.write_text(_example_spec())
    out = tmp_path / "gen"
    proc = subprocess.run(
        [sys.executable, "-m", "kgen", "all", str(spec), "--out", str(out), "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(l for l in proc.stdout.splitlines() if l.startswith("my_pool_pipeline"))
    assert row.rstrip().endswith("ok")
    run = subprocess.run(
        [sys.executable, "-c", (
            "import sys, torch; sys.path.insert(0, sys.argv[1]);"
            "from gen import my_pool_pipeline as m;"
            "print(tuple(m.Model()(torch.randn(4, 6, 40, 72)).shape))"
        ), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert run.stdout.strip() == "(4, 12)", run.stderr


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```\n(python3 -m pip install -e '\.\[test\]' && [^\n]+)\n```", README)
    assert len(commands) == 2 and commands[0].endswith("kgen all")
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
    assert "pip install torch==2.13.0" in ci
    # as a newcomer: a fresh virtual environment, activated before anything is installed
    lines = ci.splitlines()
    venv = next(i for i, l in enumerate(lines) if l.startswith("python3 -m venv "))
    activate = next(i for i, l in enumerate(lines) if l.startswith(". ") and l.endswith('/bin/activate"'))
    assert venv < activate < lines.index(commands[1])
