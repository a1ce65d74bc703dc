"""ninja builds: content-hash cache, progress lines, concurrent builders, errors traced to templates."""
import subprocess
import sys

import pytest

from conftest import ROOT, write_spec
from kgen.build import build_module, default_variant, template_of
from kgen.errors import KgenError
from kgen.render import render_spec, write_rendered

TINY = """
name: tiny_{tag}
input: {{shape: [N, 3, 8, 8], dtype: float32}}
ops:
  - max_pool2d: {{kernel_size: {k}}}
  - relu
  - sum: {{dim: [1]}}
"""


def _render(tmp_path, tag, k=2):
    spec = write_spec(tmp_path, TINY.format(tag=tag, k=k), f"{tag}.yaml")
    out = tmp_path / "gen"
    write_rendered(render_spec(spec, out), out)
    return spec, out / f"tiny_{tag}"


def test_cache_hit_and_new_key_on_change(tmp_path, capfd):
    spec, mod = _render(tmp_path, "cache")
    first = build_module(mod)
    assert first.built and first.library.exists()
    err = capfd.readouterr().err  # progress lines
    assert "kgen: building tiny_cache" in err and "compile binding.cpp" in err and "kgen: built tiny_cache" in err
    again = build_module(mod, quiet=True)
    assert not again.built and again.library == first.library
    spec.write_text(TINY.format(tag="cache", k=4))
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    changed = build_module(mod, quiet=True)
    assert changed.built and changed.library != first.library


def test_two_builders_at_once(tmp_path):
    _, mod = _render(tmp_path, "race")
    cmd = [sys.executable, "-m", "kgen", "build", "--out", str(mod.parent), mod.name]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert all(rc == 0 for *_, rc in results), results
    builds = [d for d in (mod / "_build").iterdir() if d.is_dir()]
    assert [d.name.startswith(default_variant()) for d in builds] == [True], builds  # one final dir, no leftovers
    assert sum("built" in out and "up to date" not in out for out, _, _ in results) == 1


def test_compile_error_names_the_template_and_leaves_nothing_importable(tmp_path):
    _, mod = _render(tmp_path, "broken")
    src = mod / "kernel_cpu.cpp"
    lines = src.read_text().splitlines()
    mark = next(i for i, l in enumerate(lines) if "templates/pool_reduce/kernel_cpu.cpp.j2" in l)
    lines.insert(mark + 3, "this is not C++;")
    src.write_text("\n".join(lines) + "\n")
    assert template_of(src, mark + 4) == "templates/pool_reduce/kernel_cpu.cpp.j2"
    with pytest.raises(KgenError) as err:
        build_module(mod, quiet=True)
    msg = str(err.value)
    assert "building tiny_broken failed" in msg and "kernel_cpu.cpp" in msg
    assert "templates/pool_reduce/kernel_cpu.cpp.j2" in msg
    assert not any(p.name.endswith(".so") for p in (mod / "_build").rglob("*.so") if "failed-" not in str(p))
    proc = subprocess.run(
        [sys.executable, "-c", f"from kgen.validate import import_module_dir; import_module_dir({str(mod)!r})"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert proc.returncode != 0 and "building tiny_broken failed" in proc.stderr
