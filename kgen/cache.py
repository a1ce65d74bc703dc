"""kgen's cache directory: where it is, what it holds, and its upkeep (`kgen cache`).

``kgen_cache()`` holds two kinds of entries:

- ``compiled/<name>-<key>/``: a model or partition compiled by ``kgen.compile`` or the Dynamo backend (its spec,
  sources and builds; kgen.compiler). Its key hashes kgen's own code too, so each kgen version compiles its own;
  the old ones stay until removed (`kgen cache --older-than DAYS`, `--clear`).
- ``pch/<digest>/``: the CPU build's precompiled kgen_runtime.h, one per header content, compiler and flags (~290
  MB each; kgen.build.precompiled_header_dir). A new one is made when the header changes (a new kgen version),
  and then all but the PCH_KEEP most recently used that no build used in the last RECENT_S seconds are removed.

and one file, ``dynamic_batch.json``: the Python frames whose batch the Dynamo backend asked to be a symbol, which
later processes start with the batch dynamic (kgen.backend: Dynamo then traces them once, not twice).

A use of an entry sets its modification time (``mark_used``), which is what "last used" means here.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

PCH_KEEP = 2  # precompiled headers kept besides the ones in use (a machine switching between two kgen versions)
RECENT_S = 3600  # a precompiled header used this recently may be in a build right now: never removed
KINDS = ("compiled", "pch")
DYNAMIC_BATCH_FILE = "dynamic_batch.json"  # the frames whose batch the Dynamo backend asked dynamic (kgen.backend)


def kgen_cache() -> Path:
    """kgen's cache directory: $KGEN_CACHE, else $XDG_CACHE_HOME/kgen, else ~/.cache/kgen."""
    if os.environ.get("KGEN_CACHE"):
        return Path(os.environ["KGEN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kgen"


def mark_used(entry: Path) -> None:
    """Record a use of ``entry`` (its modification time); a cache on a read-only disk is used as it is."""
    try:
        os.utime(entry)
    except OSError:
        pass


@dataclass
class Entry:
    kind: str  # compiled | pch
    path: Path
    size: int  # bytes
    used: float  # last use (modification time), seconds since the epoch


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def entries(root: Path | None = None) -> list[Entry]:
    """The cache's entries, the least recently used first."""
    root = root or kgen_cache()
    out = []
    for kind in KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.is_dir() and not p.name.startswith("tmp-"):  # (a render or PCH being made: not an entry yet)
                try:
                    out.append(Entry(kind, p, _size(p), p.stat().st_mtime))
                except OSError:
                    continue
    return sorted(out, key=lambda e: e.used)


def remove(entry: Entry) -> None:
    """Remove ``entry`` and its lock file. The folder is renamed away first, so a process looking for it finds it
    whole or not at all (it then compiles or precompiles it again)."""
    gone = entry.path.parent / f"tmp-removed-{entry.path.name}-{os.getpid()}"
    try:
        os.replace(entry.path, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)
    try:
        (entry.path.parent / f"{entry.path.name}.lock").unlink()
    except OSError:
        pass


def remove_stray_locks(root: Path | None = None, now: float | None = None, min_age: float = RECENT_S) -> None:
    """Remove the lock files of entries that are not there (a failed or removed one) and that no process took in
    the last ``min_age`` seconds."""
    root, now = root or kgen_cache(), time.time() if now is None else now
    for kind in KINDS:
        for lock in (root / kind).glob("*.lock") if (root / kind).is_dir() else ():
            try:
                if not lock.with_suffix("").exists() and now - lock.stat().st_mtime >= min_age:
                    lock.unlink()
            except OSError:
                pass


def prune_precompiled_headers(keep: int = PCH_KEEP, root: Path | None = None, now: float | None = None) -> list[Entry]:
    """Remove the precompiled headers but the ``keep`` most recently used and those used in the last RECENT_S
    seconds; returns what it removed."""
    now = time.time() if now is None else now
    pch = [e for e in entries(root) if e.kind == "pch"]
    old = [e for e in pch[:max(0, len(pch) - keep)] if now - e.used > RECENT_S]
    for e in old:
        remove(e)
    remove_stray_locks(root, now)
    return old


def human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError
