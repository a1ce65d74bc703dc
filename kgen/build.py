"""Build a rendered module with ninja into a content-addressed directory.

``generated/NAME/_build/<variant>-<key>/libNAME.so``, where ``key`` hashes the
module's sources, the shared headers, the flags, the torch version and the
CUDA architecture: any change gives a new directory, an unchanged module is
never rebuilt. A build runs in a temporary directory under a per-key file
lock and is renamed into place only when it succeeded, so two processes
building one module are safe and nothing half-built is ever importable. The
installed library's size and sha256 are recorded in ``manifest.json`` beside
it and checked before it is reported up to date or loaded; one that does not
match is rebuilt. ninja runs in its own process group, stopped with its
compilers when the build is interrupted (Ctrl-C, SIGTERM); temporary
directories of builders that died anyway are removed by the next build.

Include and library paths come from ``torch.utils.cpp_extension``; the ninja
file is kgen's own so that building never loads the library into the builder.
A CPU build puts a precompiled kgen_runtime.h (ATen's headers: about half of
binding.cpp's compile time) first on its include path, made once per header
content, compiler and flags in kgen's cache (``precompiled_header_dir``).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import cpp_extension

from .cache import kgen_cache, mark_used, prune_precompiled_headers
from .errors import KgenError
from .render import SHARED_FILES, SPLIT_FILES, TEMPLATE_MARK, part_files

BUILD_FORMAT = 1  # bump when the build recipe changes in a way the flags do not show
CPU_SOURCES = ("binding.cpp", "kernel_cpu.cpp")  # each a file, or its parts (kgen.render.SPLIT_FILES)
CUDA_SOURCES = ("kernel.cu",)
HEADERS = ("stages.h",)
MANIFEST = "manifest.json"  # beside the installed library: its size and sha256
PCH_HEADER = "kgen_runtime.h"  # every binding.cpp's first include
# Optimization of each C++ source: the CPU kernels at -O3; binding.cpp, the host's side (argument checks, ATen calls,
# one function per plan, thousands of lines for a whole model), at -O1, which halves its compile (DenseNet-201's on
# a 2-core CPU machine, 2026-12-05: 40.9 -> 21.9 s) for ~2% of the host's time of a call (a module of 60 stages on
# that CPU: 52.4 -> 53.6 us a call, medians of three runs)
CPU_OPT = {"binding.cpp": "-O1", "kernel_cpu.cpp": "-O3"}


def _log(msg: str) -> None:
    print(f"kgen: {msg}", file=sys.stderr, flush=True)


def cuda_home() -> str | None:
    home = cpp_extension.CUDA_HOME or os.environ.get("CUDA_HOME")
    nvcc = shutil.which("nvcc")
    if home is None and nvcc:
        home = str(Path(os.path.realpath(nvcc)).parent.parent)
        if not (Path(home) / "include" / "cuda_runtime.h").is_file():
            home = _nvcc_top(nvcc) or home
    return home


@functools.lru_cache(maxsize=None)
def _nvcc_top(nvcc: str) -> str | None:
    """The toolkit an ``nvcc`` on PATH belongs to, as nvcc itself reports it (``TOP``): where that nvcc is a
    wrapper script (``exec /usr/local/cuda-13.0/bin/nvcc "$@"`` in /usr/local/bin), its own folder's parent has no
    CUDA headers for the host compiler."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ TOP="):
            top = Path(os.path.realpath(line.split("=", 1)[1].strip()))
            return str(top) if (top / "include" / "cuda_runtime.h").is_file() else None
    return None


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
            cpu_opt=CPU_OPT,
            cuda_flags=self.cuda_flags,
            ldflags=self.ldflags,
            torch=torch.__version__,
            format=BUILD_FORMAT,
        )


def toolchain(variant: str, include_dirs: list[str]) -> Toolchain:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    torch_inc = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    incs = [f"-I{d}" for d in include_dirs]
    cflags = ["-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"] + incs + torch_inc  # (the -O: CPU_OPT)
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


def compiled_sources(module_dir: Path, variant: str) -> list[tuple[str, Path]]:
    """(source, file) of each file the build compiles: ``source`` names the rendered file it is (a part of), which
    sets its flags (``binding.cpp``, ``kernel_cpu.cpp``, ``kernel.cu``)."""
    out = []
    for src in CPU_SOURCES + (CUDA_SOURCES if variant == "cuda" else ()):
        parts = part_files(module_dir, src) if src in SPLIT_FILES else []
        out += [(src, f) for f in parts or [module_dir / src]]
    return out


def module_sources(module_dir: Path, variant: str) -> list[Path]:
    files = ([f for _, f in compiled_sources(module_dir, variant)] + [module_dir / n for n in HEADERS]
             + [module_dir.parent / n for n in SHARED_FILES])
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
def _writable(root: Path, name: str):
    """A file system error while preparing or installing a build, as one line."""
    try:
        yield
    except OSError as e:
        where = e.filename or root
        raise KgenError(f"building {name}: cannot write {where}: {e.strerror or e}") from None


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=None)
def _cxx_version(cxx: str) -> str:
    return subprocess.run([cxx, "-dumpfullversion"], capture_output=True, text=True, check=True).stdout.strip()


def precompiled_header_dir(module_dir: Path, tc: Toolchain) -> Path | None:
    """A directory holding PCH_HEADER.gch for ``tc`` (a CPU toolchain), made once per header content,
    compiler, flags and torch version under kgen_cache()/pch (11 s and ~290 MB on the CI machine; older ones
    pruned: kgen.cache) and put
    first on the build's include path: g++ reads it where its settings match the compile's and the
    header otherwise, so no build needs it (binding.cpp: 7.1 -> 4.0 s). None for CUDA builds (not
    measured there), with KGEN_PCH=0, or where g++ could not make it."""
    if tc.variant != "cpu" or os.environ.get("KGEN_PCH", "1") == "0":
        return None
    header = module_dir.parent / PCH_HEADER
    # binding.cpp's flags (the module's own include paths do not matter)
    flags = [CPU_OPT["binding.cpp"]] + [f for f in tc.cflags if not f.startswith("-I")]
    try:
        digest = hashlib.sha256(json.dumps([header.read_bytes().hex(), tc.cxx, _cxx_version(tc.cxx), flags, torch.__version__]).encode())
        out = kgen_cache() / "pch" / digest.hexdigest()[:24]
        if (out / f"{PCH_HEADER}.gch").exists():
            mark_used(out)
            return out
        with _file_lock(out.parent / f"{out.name}.lock"):
            if (out / f"{PCH_HEADER}.gch").exists():  # another build made it meanwhile
                mark_used(out)
                return out
            _log(f"precompiling {PCH_HEADER} for CPU builds into {out} (once) ...")
            tmp = out.parent / f"tmp-{out.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                subprocess.run([tc.cxx, *flags, "-Wno-pragma-once-outside-header", "-x", "c++-header", str(header), "-o",
                                str(tmp / f"{PCH_HEADER}.gch")], capture_output=True, check=True)
                shutil.rmtree(out, ignore_errors=True)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # a failed or interrupted one leaves nothing
        mark_used(out)
        for old in prune_precompiled_headers():  # a new header (a new kgen): the ones no build uses any more
            _log(f"removed the precompiled header {old.path} (last used {time.ctime(old.used)})")
        return out
    except (OSError, subprocess.CalledProcessError) as e:
        _log(f"note: no precompiled {PCH_HEADER} ({e}); building from the header")
        return None


def _ninja_file(module_dir: Path, tc: Toolchain, lib_name: str, pch_dir: Path | None = None) -> str:
    q = lambda flags: " ".join(flags)  # noqa: E731 - flags never contain spaces we did not put there
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {tc.cxx}",
        f"cflags = {q(([f'-I{pch_dir}'] if pch_dir else []) + tc.cflags)}",
        f"ldflags = {q(tc.ldflags)}",
        "rule cxx",
        "  command = $cxx -MMD -MF $out.d $opt $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $src",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = link $out",
    ]
    objs = []
    if tc.variant == "cuda":
        lines += [
            f"nvcc = {tc.nvcc}",
            f"cuda_flags = {q(tc.cuda_flags)}",
            "rule nvcc",
            "  command = $nvcc $cuda_flags -c $in -o $out",
            "  description = nvcc $src",
        ]
    for src, f in compiled_sources(module_dir, tc.variant):
        if f.suffix == ".cu":
            obj = f.name.replace(".cu", ".cuda.o")
            lines += [f"build {obj}: nvcc {f}", f"  src = {f.name}"]
        else:
            obj = f.name.replace(".cpp", ".o")
            lines += [f"build {obj}: cxx {f}", f"  src = {f.name}", f"  opt = {CPU_OPT[src]}"]
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
    # ptxas C7518: it serialized the kernel's wgmma instructions (each waits for the last), e.g. for
    # accumulators touched on a divergent path: correct, but the asynchronous MMAs lose their overlap
    serialized_wgmma: bool = False

    @property
    def clean(self) -> bool:
        return self.stack == 0 and self.spill_stores == 0 and self.spill_loads == 0 and not self.serialized_wgmma


def parse_ptxas(text: str) -> list[PtxasKernel]:
    """Per-kernel registers, stack frame, spills and serialized wgmma from `nvcc -Xptxas -v` output."""
    kernels, current = [], None
    serialized = set(re.findall(r"wgmma\.mma_async instructions are serialized.*?in the function '([^']+)'", text))
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
    for k in kernels:
        k.serialized_wgmma = k.name in serialized
    return kernels


def demangle(name: str) -> str:
    try:
        return subprocess.run(["c++filt", name], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return name


# ------------------------------------------------------------ installed libraries


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(build_dir: Path, lib_name: str) -> None:
    lib = build_dir / lib_name
    data = {"library": lib_name, "size": lib.stat().st_size, "sha256": _sha256(lib)}
    tmp = build_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, build_dir / MANIFEST)


def install_problem(build_dir: Path, lib_name: str) -> str | None:
    """What is wrong with the library installed in ``build_dir``, or None if it is as built."""
    lib = build_dir / lib_name
    try:
        size = lib.stat().st_size
    except OSError:
        return "the library is missing"
    try:
        data = json.loads((build_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return "its manifest is missing or unreadable"
    if not isinstance(data, dict) or data.get("library") != lib_name:
        return "its manifest is corrupt"
    if size != data.get("size"):
        return f"it has {size} bytes, the manifest records {data.get('size')}"
    if _sha256(lib) != data.get("sha256"):
        return "its sha256 differs from the manifest's"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_temp_dirs(build_root: Path) -> None:
    """Remove ``tmp-*-PID`` build directories whose builder process is gone."""
    for d in build_root.glob("tmp-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------ running ninja

_RUNNING: set = set()  # ninja processes this process started and has not reaped
_RUNNING_LOCK = threading.Lock()


def _stop(proc: subprocess.Popen) -> None:
    """Stop a ninja started in its own process group; ninja stops its compile jobs on SIGTERM."""
    proc.kgen_stopped = True
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_all_builds() -> None:
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        _stop(proc)


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def _interruptible():
    """On the main thread, run builds so that an interruption stops them: SIGTERM
    becomes SystemExit meanwhile (by default it would end the process at once and
    leave ninja compiling), and Ctrl-C or SIGTERM stops every running ninja, also
    those of worker threads. Elsewhere a no-op: signals reach the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if installed:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        stop_all_builds()
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_ninja(build_dir: Path, name: str, quiet: bool) -> tuple[int, str]:
    """Run ninja in ``build_dir`` in a process group of its own; returns (exit status, output)."""
    proc = subprocess.Popen(
        [_ninja(), "-C", str(build_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # Ctrl-C reaches kgen only; kgen stops ninja and its jobs (_stop)
    )
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if not quiet and re.match(r"^\[\d+/\d+\] ", line):
                _log(f"  {name}: {line.strip()}")
        proc.wait()
    except BaseException:
        _stop(proc)
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
        proc.stdout.close()
    if getattr(proc, "kgen_stopped", False):  # stopped by an interruption on the main thread
        raise KgenError(f"building {name} was interrupted")
    return proc.returncode, "".join(log)


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

    if install_problem(final, lib_name) is None:
        return done(False)
    with _interruptible(), _writable(root, name), _file_lock(root / f"{variant}-{key}.lock"):
        remove_dead_temp_dirs(root)
        problem = install_problem(final, lib_name)  # another process may have built it meanwhile
        if problem is None:
            return done(False)
        if final.exists():
            _log(f"note: {name}: the installed {final / lib_name} does not match what was built ({problem}); rebuilding")
            stale = root / f"tmp-stale-{variant}-{key}-{os.getpid()}"
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f"tmp-{variant}-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            (tmp / "build.ninja").write_text(_ninja_file(module_dir, tc, lib_name, precompiled_header_dir(module_dir, tc)))
            if not quiet:
                _log(f"building {name} ({variant}{', ' + ' '.join(cuda_arch_flags()) if variant == 'cuda' else ''}) ...")
            returncode, output = _run_ninja(tmp, name, quiet)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / "build.log").write_text(output)
        if returncode != 0:
            failed = root / f"failed-{variant}-{key}"
            shutil.rmtree(failed, ignore_errors=True)
            os.replace(tmp, failed)
            detail = explain_compile_errors(output) or "\n".join(output.strip().splitlines()[-15:])
            raise KgenError(f"building {name} failed (full log: {failed / 'build.log'}):\n{detail}")
        (tmp / "ptxas.txt").write_text(output)
        write_manifest(tmp, lib_name)
        os.replace(tmp, final)
    result = done(True)
    if not quiet:
        _log(f"built {name} in {result.seconds:.1f} s")
    for k in result.ptxas:
        if not k.clean:
            _log(f"warning: {name}: {demangle(k.name)} uses {k.stack} bytes of stack, spills {k.spill_stores}/{k.spill_loads} bytes")
    return result


def build_modules(module_dirs, variant: str | None = None, failures: dict | None = None,
                  quiet: bool = False) -> list[BuildResult]:
    """Build several modules at once (each ninja runs its own jobs); the first failure is raised,
    or, given ``failures``, recorded there (module directory -> the error's first line) and the
    others still built (kgen tune, the Dynamo backend's partitions)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(d):
        try:
            return build_module(d, variant, quiet=quiet)
        except KgenError as e:
            if failures is None:
                raise
            failures[d] = str(e).splitlines()[0]
            return None

    # _interruptible inside: an interruption stops the builds before the pool waits for its threads
    with ThreadPoolExecutor(max_workers=max(1, min(len(module_dirs), os.cpu_count() or 1))) as pool, _interruptible():
        futures = [pool.submit(one, d) for d in module_dirs]
        return [r for r in (f.result() for f in futures) if r is not None]


def ensure_built(module_dir: Path) -> Path:
    """The library of ``module_dir`` for this machine, building it first if needed."""
    return build_module(module_dir).library


def ptxas_report(module_dir: Path, arch: str = "9.0a") -> list[PtxasKernel]:
    """Compile kernel.cu (each of its parts) alone (no torch needed) and return ptxas' per-kernel report."""
    module_dir = Path(module_dir).resolve()
    home = cuda_home()
    if home is None:
        raise KgenError("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    out_dir = module_dir / "_build" / "ptxas"
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = []
    for src in (f for s, f in compiled_sources(module_dir, "cuda") if s in CUDA_SOURCES):
        cmd = [
            str(Path(home) / "bin" / "nvcc"), "-O3", "-std=c++17", "-Xptxas", "-v", *cuda_arch_flags(arch),
            f"-I{module_dir.parent}", f"-I{module_dir}", "-c", str(src), "-o", str(out_dir / f"{src.stem}.o"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise KgenError(f"nvcc failed on {src}:\n{explain_compile_errors(output) or output[-2000:]}")
        kernels += parse_ptxas(output)
    return kernels
