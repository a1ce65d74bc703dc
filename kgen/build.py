"""Build a rendered module with ninja into a content-addressed directory.

``generated/NAME/_build/<variant>-<key>/libNAME.so``, where ``key`` hashes the
module's sources, the shared headers, the flags, the torch version and the
CUDA architecture: any change gives a new directory, an unchanged module is
never rebuilt. A build runs in a temporary directory under a per-key file
lock and is renamed into place only when it succeeded, so two processes
building one module are safe and nothing half-built is ever importable.

Include and library paths come from ``torch.utils.cpp_extension``; the ninja
file is kgen's own so that building never loads the library into the builder.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import cpp_extension

from .errors import KgenError
from .render import SHARED_FILES, TEMPLATE_MARK

BUILD_FORMAT = 1  # bump when the build recipe changes in a way the flags do not show
CPU_SOURCES = ("binding.cpp", "kernel_cpu.cpp")
CUDA_SOURCES = ("kernel.cu",)
HEADERS = ("stages.h",)


def _log(msg: str) -> None:
    print(f"kgen: {msg}", file=sys.stderr, flush=True)


def cuda_home() -> str | None:
    home = cpp_extension.CUDA_HOME or os.environ.get("CUDA_HOME")
    if home is None and shutil.which("nvcc"):
        home = str(Path(os.path.realpath(shutil.which("nvcc"))).parent.parent)
    return home


def cuda_arch_flags(arch_list: str | None = None) -> list[str]:
    """-gencode flags: TORCH_CUDA_ARCH_LIST ("9.0a;8.0"), else this GPU, else sm_90a.

    Hopper gets the "a" target (sm_90a) unless the list names plain 9.0.
    """
    arch_list = arch_list or os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list:
        archs = [a.strip() for a in re.split(r"[;\s]+", arch_list) if a.strip()]
    elif torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        archs = [f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")]
    else:
        archs = ["9.0a"]
    flags = []
    for a in archs:
        a = a.replace("+PTX", "")
        num = a.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def default_variant() -> str:
    """'cuda' when this torch can run CUDA and nvcc is there, else 'cpu' (KGEN_DEVICE overrides)."""
    forced = os.environ.get("KGEN_DEVICE")
    if forced in ("cpu", "cuda"):
        return forced
    return "cuda" if torch.cuda.is_available() and torch.version.cuda and cuda_home() else "cpu"


@dataclass
class Toolchain:
    variant: str
    cxx: str
    nvcc: str | None
    cflags: list[str]
    cuda_flags: list[str]
    ldflags: list[str]

    def fingerprint(self) -> dict:
        return dict(
            variant=self.variant,
            cflags=self.cflags,
            cuda_flags=self.cuda_flags,
            ldflags=self.ldflags,
            torch=torch.__version__,
            format=BUILD_FORMAT,
        )


def toolchain(variant: str, include_dirs: list[str]) -> Toolchain:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    torch_inc = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    incs = [f"-I{d}" for d in include_dirs]
    cflags = ["-O3", "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"] + incs + torch_inc
    torch_lib = cpp_extension.library_paths()[0]
    ldflags = ["-shared", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch"]
    cuda_flags, nvcc = [], None
    if variant == "cuda":
        home = cuda_home()
        if home is None:
            raise KgenError("a CUDA build needs nvcc: set CUDA_HOME or put nvcc on PATH (or set KGEN_DEVICE=cpu)")
        nvcc = str(Path(home) / "bin" / "nvcc")
        cflags += ["-DKGEN_WITH_CUDA", f"-isystem{home}/include"]
        cuda_flags = (
            ["-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC", "-Xptxas", "-v"]
            + cuda_arch_flags()
            + incs
        )
        ldflags += ["-lc10_cuda", "-ltorch_cuda", f"-L{home}/lib64", "-lcudart"]
    cxx = os.environ.get("CXX", "c++")
    return Toolchain(variant, cxx, nvcc, cflags, cuda_flags, ldflags)


def module_sources(module_dir: Path, variant: str) -> list[Path]:
    names = CPU_SOURCES + HEADERS + (CUDA_SOURCES if variant == "cuda" else ())
    files = [module_dir / n for n in names] + [module_dir.parent / n for n in SHARED_FILES]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise KgenError(f"{module_dir.name}: missing rendered sources {', '.join(missing)}; run `kgen render` first")
    return files


def build_key(module_dir: Path, tc: Toolchain) -> str:
    h = hashlib.sha256()
    for f in module_sources(module_dir, tc.variant):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps(tc.fingerprint(), sort_keys=True).encode())
    return h.hexdigest()[:16]


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ninja_file(module_dir: Path, tc: Toolchain, lib_name: str) -> str:
    q = lambda flags: " ".join(flags)  # noqa: E731 - flags never contain spaces we did not put there
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {tc.cxx}",
        f"cflags = {q(tc.cflags)}",
        f"ldflags = {q(tc.ldflags)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $src",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = link $out",
    ]
    objs = []
    for src in CPU_SOURCES:
        obj = src.replace(".cpp", ".o")
        lines += [f"build {obj}: cxx {module_dir / src}", f"  src = {src}"]
        objs.append(obj)
    if tc.variant == "cuda":
        lines += [
            f"nvcc = {tc.nvcc}",
            f"cuda_flags = {q(tc.cuda_flags)}",
            "rule nvcc",
            "  command = $nvcc $cuda_flags -c $in -o $out",
            "  description = nvcc $src",
        ]
        for src in CUDA_SOURCES:
            obj = src.replace(".cu", ".cuda.o")
            lines += [f"build {obj}: nvcc {module_dir / src}", f"  src = {src}"]
            objs.append(obj)
    lines.append(f"build {lib_name}: link {' '.join(objs)}")
    lines.append(f"default {lib_name}")
    return "\n".join(lines) + "\n"


def _ninja() -> str:
    exe = shutil.which("ninja")
    if exe is None:
        try:
            import ninja  # the PyPI package ships the binary

            exe = str(Path(ninja.BIN_DIR) / "ninja")
        except ImportError:
            raise KgenError("ninja is not installed: pip install ninja") from None
    return exe


_ERROR_LINE = re.compile(r"^(?P<file>[^\s:()]+?)(?::(?P<line>\d+)(?::\d+)?|\((?P<line2>\d+)\)):?\s*(?:fatal )?error\b.*", re.M)


def template_of(path: Path, line: int) -> str | None:
    """The template that produced ``line`` of a generated file (nearest mark above it)."""
    try:
        lines = path.read_text().splitlines()[:line]
    except OSError:
        return None
    for text in reversed(lines):
        if TEMPLATE_MARK in text:
            return text.split(TEMPLATE_MARK, 1)[1].strip().rstrip(")")
    return None


def explain_compile_errors(output: str, limit: int = 8) -> str:
    """The compiler's error lines, each with the template its generated line came from."""
    out = []
    for m in _ERROR_LINE.finditer(output):
        path, line = Path(m["file"]), int(m["line"] or m["line2"])
        tpl = template_of(path, line)
        where = f" [from {tpl}]" if tpl else ""
        out.append(f"  {m.group(0).strip()}{where}")
        if len(out) >= limit:
            break
    return "\n".join(out)


@dataclass
class PtxasKernel:
    name: str
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int

    @property
    def clean(self) -> bool:
        return self.stack == 0 and self.spill_stores == 0 and self.spill_loads == 0


def parse_ptxas(text: str) -> list[PtxasKernel]:
    """Per-kernel registers, stack frame and spills from `nvcc -Xptxas -v` output."""
    kernels, current = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = PtxasKernel(m.group(1), 0, 0, 0, 0)
            kernels.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current.registers = int(m.group(1))
    return kernels


def demangle(name: str) -> str:
    try:
        return subprocess.run(["c++filt", name], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return name


@dataclass
class BuildResult:
    name: str
    library: Path
    built: bool  # False: it was already up to date
    seconds: float
    ptxas: list[PtxasKernel]


def build_module(module_dir: Path, variant: str | None = None, quiet: bool = False) -> BuildResult:
    """Build ``module_dir`` (a rendered generated/NAME) unless its key is built already."""
    module_dir = Path(module_dir).resolve()
    name = module_dir.name
    variant = variant or default_variant()
    tc = toolchain(variant, [str(module_dir.parent), str(module_dir)])
    key = build_key(module_dir, tc)
    root = module_dir / "_build"
    final = root / f"{variant}-{key}"
    lib_name = f"lib{name}.so"
    start = time.monotonic()

    def done(built: bool) -> BuildResult:
        ptx = final / "ptxas.txt"
        kernels = parse_ptxas(ptx.read_text()) if ptx.exists() else []
        return BuildResult(name, final / lib_name, built, time.monotonic() - start, kernels)

    if (final / lib_name).exists():
        return done(False)
    with _file_lock(root / f"{variant}-{key}.lock"):
        if (final / lib_name).exists():  # another process built it while we waited
            return done(False)
        tmp = root / f"tmp-{variant}-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "build.ninja").write_text(_ninja_file(module_dir, tc, lib_name))
        if not quiet:
            _log(f"building {name} ({variant}{', ' + ' '.join(cuda_arch_flags()) if variant == 'cuda' else ''}) ...")
        proc = subprocess.Popen(
            [_ninja(), "-C", str(tmp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        log = []
        for line in proc.stdout:
            log.append(line)
            if not quiet and re.match(r"^\[\d+/\d+\] ", line):
                _log(f"  {name}: {line.strip()}")
        proc.wait()
        output = "".join(log)
        (tmp / "build.log").write_text(output)
        if proc.returncode != 0:
            failed = root / f"failed-{variant}-{key}"
            shutil.rmtree(failed, ignore_errors=True)
            os.replace(tmp, failed)
            detail = explain_compile_errors(output) or "\n".join(output.strip().splitlines()[-15:])
            raise KgenError(f"building {name} failed (full log: {failed / 'build.log'}):\n{detail}")
        (tmp / "ptxas.txt").write_text(output)
        os.replace(tmp, final)
    result = done(True)
    if not quiet:
        _log(f"built {name} in {result.seconds:.1f} s")
    for k in result.ptxas:
        if not k.clean:
            _log(f"warning: {name}: {demangle(k.name)} uses {k.stack} bytes of stack, spills {k.spill_stores}/{k.spill_loads} bytes")
    return result


def build_modules(module_dirs, variant: str | None = None) -> list[BuildResult]:
    """Build several modules at once (each ninja runs its own jobs); the first failure is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(module_dirs), os.cpu_count() or 1))) as pool:
        futures = [pool.submit(build_module, d, variant) for d in module_dirs]
        return [f.result() for f in futures]


def ensure_built(module_dir: Path) -> Path:
    """The library of ``module_dir`` for this machine, building it first if needed."""
    return build_module(module_dir).library


def ptxas_report(module_dir: Path, arch: str = "9.0a") -> list[PtxasKernel]:
    """Compile kernel.cu alone (no torch needed) and return ptxas' per-kernel report."""
    module_dir = Path(module_dir).resolve()
    home = cuda_home()
    if home is None:
        raise KgenError("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    out_dir = module_dir / "_build" / "ptxas"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(Path(home) / "bin" / "nvcc"), "-O3", "-std=c++17", "-Xptxas", "-v", *cuda_arch_flags(arch),
        f"-I{module_dir.parent}", f"-I{module_dir}", "-c", str(module_dir / "kernel.cu"), "-o", str(out_dir / "kernel.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        raise KgenError(f"nvcc failed on {module_dir / 'kernel.cu'}:\n{explain_compile_errors(output) or output[-2000:]}")
    return parse_ptxas(proc.stdout + proc.stderr)
