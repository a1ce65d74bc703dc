"""ninja builds: content-hash cache, progress lines, concurrent builders, errors traced to templates,
verified installs, interrupted builds, unwritable output."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kgen.build
from conftest import ROOT, fresh_kgen_cache, kgen_cli, write_spec
from kgen.build import build_module, default_variant, install_problem, template_of, write_manifest
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


def test_cpu_builds_read_a_precompiled_runtime_header(tmp_path, monkeypatch):
    """A CPU build puts kgen_runtime.h precompiled (once per header content, compiler and flags, in
    KGEN_CACHE) first on its include path; another module with the same header reuses it; a changed
    header gets its own; KGEN_PCH=0 builds from the header. The libraries compute alike."""
    from kgen.validate import import_module_dir

    # kgen's usual precompiled header (fresh_kgen_cache): made by an earlier build in the suite, not made again
    # here (11 s); the changed header's is made here
    with fresh_kgen_cache(tmp_path) as cache:
        _, a = _render(tmp_path, "pch_a")
        _, b = _render(tmp_path, "pch_b", k=4)
        built = kgen.build.build_modules([a, b], "cpu")  # at once: both read the one header, made once
        pch = kgen.build.precompiled_header_dir(a, kgen.build.toolchain("cpu", [str(a.parent), str(a)]))
        assert pch.parent == cache / "pch" and (pch / "kgen_runtime.h.gch").exists()
        for r in built:
            ninja = (r.library.parent / "build.ninja").read_text()
            assert ninja.count(f"cflags = -I{pch} ") == 1
            # the host's side at -O1 (its compile halved), the CPU kernels at -O3 (kgen.build.CPU_OPT)
            assert "src = binding.cpp\n  opt = -O1" in ninja and "src = kernel_cpu.cpp\n  opt = -O3" in ninja
        header = a.parent / "kgen_runtime.h"
        header.write_text(header.read_text() + "\n// changed\n")
        other = kgen.build.precompiled_header_dir(a, kgen.build.toolchain("cpu", [str(a.parent), str(a)]))
        try:
            assert other != pch and other.parent == cache / "pch" and (other / "kgen_runtime.h.gch").exists()
        finally:
            if other is not None and other != pch:
                shutil.rmtree(other, ignore_errors=True)  # ~290 MB a header, in kgen's usual cache
        monkeypatch.setenv("KGEN_PCH", "0")
        _, c = _render(tmp_path, "pch_c")  # a's ops
        plain = build_module(c, "cpu", quiet=True)
        assert "-I" + str(cache) not in (plain.library.parent / "build.ninja").read_text()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(import_module_dir(a).Model()(x), import_module_dir(c).Model()(x), rtol=0, atol=0)


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


# ---- safety: verified installs, interrupted builds, unwritable output


def _kgen_build(out, name):
    return kgen_cli("build", "--out", out, name)


def test_manifest_records_and_checks_the_library(tmp_path):
    d = tmp_path / "cpu-0123"
    d.mkdir()
    lib = d / "libm.so"
    lib.write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
    assert install_problem(d, "libm.so") == "its manifest is missing or unreadable"
    write_manifest(d, "libm.so")
    assert install_problem(d, "libm.so") is None
    data = bytearray(lib.read_bytes())
    data[100] ^= 1
    lib.write_bytes(bytes(data))  # same size, other content
    assert "sha256" in install_problem(d, "libm.so")
    lib.write_bytes(bytes(data[:50]))  # truncated
    assert "50 bytes" in install_problem(d, "libm.so")
    (d / "manifest.json").write_text("{not json")
    assert "unreadable" in install_problem(d, "libm.so")
    (d / "manifest.json").write_text('["libm.so"]')
    assert install_problem(d, "libm.so") == "its manifest is corrupt"
    lib.unlink()
    assert install_problem(d, "libm.so") == "the library is missing"


def _fake_ninja(build_dir, name, quiet):
    """Stands in for ninja: 'builds' a library of fixed content, without compiling."""
    (build_dir / f"lib{name}.so").write_bytes(b"\x7fELF" * 999)
    return 0, ""


def test_corrupted_library_is_rebuilt_and_dead_builders_are_cleaned_up(tmp_path, monkeypatch, capfd):
    _, mod = _render(tmp_path, "corrupt")
    monkeypatch.setattr(kgen.build, "_run_ninja", _fake_ninja)
    lib = build_module(mod, quiet=True).library
    assert (lib.parent / "manifest.json").exists() and install_problem(lib.parent, lib.name) is None
    assert not build_module(mod, quiet=True).built
    lib.write_bytes(lib.read_bytes()[:1000])  # truncated in place
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (mod / "_build" / f"tmp-cpu-0000-{dead.pid}").mkdir()  # a builder that died
    (mod / "_build" / f"tmp-cpu-0000-{os.getpid()}").mkdir()  # one still running
    capfd.readouterr()
    again = build_module(mod, quiet=True)
    assert again.built and again.library == lib and install_problem(lib.parent, lib.name) is None
    note = [l for l in capfd.readouterr().err.splitlines() if "note:" in l]
    assert len(note) == 1 and "does not match" in note[0] and "rebuilding" in note[0]
    assert not (mod / "_build" / f"tmp-cpu-0000-{dead.pid}").exists()
    assert (mod / "_build" / f"tmp-cpu-0000-{os.getpid()}").exists()
    (lib.parent / "manifest.json").unlink()
    assert build_module(mod, quiet=True).built  # no manifest: rebuilt too
    assert not build_module(mod, quiet=True).built


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{p.name}: {cmd}")
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_killed_build_leaves_no_compiler_running(tmp_path, sig):
    _, mod = _render(tmp_path, f"killed_{sig.name.lower()}")
    # SIGINT as a terminal delivers it: a shell starts background jobs with SIGINT ignored, and the child
    # would inherit that (then the build runs to the end and this test fails for the launcher's reasons)
    proc = subprocess.Popen([sys.executable, "-m", "kgen", "build", "--out", str(mod.parent), mod.name],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any("binding.cpp" in c for c in _processes_mentioning(str(mod))):  # the compiler runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in err
    # Stopped compilers exit at once; orphans would run on and write their objects.
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(mod)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [c[:200] for c in _processes_mentioning(str(mod))] == []
    assert not list(mod.rglob("*.o")), "a compiler went on after kgen was stopped"
    assert not list((mod / "_build").glob("tmp-*")), "the stopped build left its temporary directory"
    assert not [d for d in (mod / "_build").glob(f"{default_variant()}-*") if d.is_dir()], "the build went on after the signal"


def test_unwritable_build_directory_is_one_line(tmp_path):
    _, mod = _render(tmp_path, "unwritable")
    (mod / "_build").write_text("a file where the build directory goes\n")
    proc = _kgen_build(mod.parent, mod.name)
    assert proc.returncode == 1
    assert proc.stderr.startswith("kgen: error: building tiny_unwritable: cannot write ") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_unwritable_render_output_is_one_line_and_writes_nothing(tmp_path):
    spec = write_spec(tmp_path, TINY.format(tag="ro", k=2), "ro.yaml")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    proc = kgen_cli("render", spec, "--out", blocker / "gen")
    assert proc.returncode == 1 and proc.stderr.startswith("kgen: error: tiny_ro: cannot write ")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_generated_directory_is_one_line(tmp_path):
    spec = write_spec(tmp_path, TINY.format(tag="readonly", k=2), "readonly.yaml")
    out = tmp_path / "gen"
    write_rendered(render_spec(spec, out), out)
    for d in (out, out / "tiny_readonly"):
        d.chmod(0o555)
    try:
        rendered = kgen_cli("render", spec.with_name("x.yaml"), "--out", out)
        proc = _kgen_build(out, "tiny_readonly")
    finally:
        for d in (out, out / "tiny_readonly"):
            d.chmod(0o755)
    assert rendered.returncode == 1
    assert proc.returncode == 1 and "Permission denied" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_second_library_of_the_same_module_name_is_refused(tmp_path, monkeypatch):
    """The dispatcher takes one kgen::NAME definition per process and aborts the process on a second
    library of that name: load_library says so instead (and loads the same library again as before)."""
    import kgen.build
    from kgen import runtime
    from kgen.errors import KgenError

    loaded = []
    monkeypatch.setattr(kgen.build, "ensure_built", lambda d: d / "_build" / "lib.so")
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(runtime, "_LOADED", {})
    first, second = (tmp_path / d / "kgen_twice" / "module.py" for d in ("a", "b"))
    runtime.load_library(str(first))
    runtime.load_library(str(first))  # the same library: fine
    with pytest.raises(KgenError, match=r"kgen::kgen_twice is already registered .*a[/\\]kgen_twice"):
        runtime.load_library(str(second))
    assert loaded == [str(first.parent / "_build" / "lib.so")] * 2


def test_ptxas_report_flags_spills_and_serialized_wgmma():
    """The parser behind every check here: a kernel is clean without stack, spills or serialized wgmma."""
    from kgen.build import parse_ptxas

    text = """ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
program dependence on compiler-inserted WG.DP in divergent path in the function '_Z1av'
ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 200 registers, used 16 barriers
ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers
ptxas info    : Compiling entry function '_Z1cv' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers"""
    a, b, c = parse_ptxas(text)
    assert (a.name, a.registers, a.serialized_wgmma, a.clean) == ("_Z1av", 200, True, False)
    assert (b.stack, b.spill_stores, b.clean) == (8, 4, False)
    assert c.clean and not c.serialized_wgmma


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_home_of_an_nvcc_wrapper_script_is_its_toolkit(tmp_path, monkeypatch):
    """An nvcc on PATH that is a wrapper script (``exec /usr/local/cuda-X/bin/nvcc "$@"``): its folder's parent
    has no CUDA headers for the host compiler; the toolkit is the one nvcc reports."""
    from torch.utils import cpp_extension

    from kgen import build

    real = shutil.which("nvcc")
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    home = build.cuda_home()
    assert home is not None and (Path(home) / "include" / "cuda_runtime.h").is_file(), home
    assert not Path(home).is_relative_to(tmp_path)
