"""Tuning files: ``specs/NAME.tune.json`` beside the spec, written by `kgen tune`.

This module is their only reader and writer. A file holds one entry per
device and dtype it was tuned on (`kgen tune --dtype`):

    {"format": 1, "spec": "specs/NAME.yaml", "entries": [{
        "device": "NVIDIA H200",                 # torch.cuda.get_device_name()
        "dtype": "bfloat16",                      # the plans it measured; absent: float32's
        "versions": {"torch": ..., "cuda": ..., "cudnn": ..., "kgen": commit},
        "date": ..., "reps": 30,
        "spec_hash": ...,                         # the spec as data (its example batch left out)
        "candidates_hash": ...,                   # the candidate plans kgen offered for it
        "candidates": [{"id": "c0", "choices": {decision: option},
                        "model_ms": {batch: ms}, "measured_ms": {batch: ms}}, ...],
        "ranges": [{"min": 1, "max": 11, "tuned_at": 8, "candidate": "c3", "choices": {...}, "ms": ...},
                   {"min": 12, "max": null, ...}],
        "eager_conv_tf32": {"conv": true}}]}      # per convolution module: eager's cuDNN call ran TF32
                                                  # at the example batch (kgen.tune.measure_eager_conv_tf32)

`kgen tune --precision-only` writes an entry of the last key alone (with the
device, versions and spec_hash; no candidates or ranges): the cost model
chooses the plans, knowing eager's precision on that device.

An entry applies to the plans of its dtype when its device is the render
target's (``Target.name``; the default target is the H200, so the committed
H200 entries give the committed ``generated/`` files on a CPU-only machine too)
and both hashes match what kgen computes now; otherwise it is ignored with a
note saying why (another device, the spec changed, kgen's candidates changed:
retune). A float32 entry has no "dtype" key (files written before 16-bit
tuning read as they did); a dtype without entries has no note: the cost model
chooses its plans.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import KgenError, one_line
from .spec import spec_to_data

FORMAT = 1
SUFFIX = ".tune.json"


def path_for(spec_path) -> Path:
    p = Path(spec_path)
    return p.with_name(p.name.removesuffix(".yaml").removesuffix(".yml") + SUFFIX)


def spec_hash(pipe) -> str:
    """What the spec computes, as data: its example batch (what bench and tune default to) is left out, and
    so are the rewrites left on (the default), so a rewrite kgen adds does not stale every tuning file (where
    it changes the candidates, the candidates' hash says so)."""
    data = spec_to_data(pipe.spec)
    off = {k: v for k, v in data.get("rewrites", {}).items() if not v}
    if off:
        data["rewrites"] = off
    else:
        data.pop("rewrites", None)
    if "input" in data:
        data["input"] = {k: v for k, v in data["input"].items() if k != "example"}
    # the entries measure the float32 plans (kgen tune): a spec that adds a 16-bit dtype keeps them
    for inp in [data["input"]] if "input" in data else data["inputs"].values():
        inp["dtype"] = "float32"
    data.pop("example", None)  # a spec with several inputs gives its example batch beside them
    return _digest(data)


def candidates_hash(plans) -> str:
    """The candidate plans kgen offers, each by its choices."""
    return _digest(sorted(json.dumps(p.choices, sort_keys=True) for p in plans))


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Range:
    lo: int
    hi: int | None  # None: no upper bound
    tuned_at: int  # the measured batch it was chosen at
    choices: dict
    ms: float

    def covers(self, batch: int) -> bool:
        return batch >= self.lo and (self.hi is None or batch <= self.hi)


@dataclass(frozen=True)
class Entry:
    path: Path
    device: str
    ranges: tuple[Range, ...]
    data: dict  # the whole entry, as stored
    dtype: str = "float32"  # the plans it measured


def read(path: Path) -> dict | None:
    """The file's data, None when there is none; a malformed file is a one-line error."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KgenError(f"{path}: not a readable tuning file ({one_line(str(e), 80)}); run `kgen tune` again or delete it") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise KgenError(f"{path}: not a kgen tuning file of format {FORMAT}; run `kgen tune` again or delete it")
    return data


def _ranges(path: Path, e: dict) -> tuple[Range, ...]:
    try:
        ranges = tuple(Range(int(r["min"]), None if r["max"] is None else int(r["max"]), int(r["tuned_at"]),
                             dict(r["choices"]), float(r["ms"])) for r in e["ranges"])
    except (KeyError, TypeError, ValueError) as err:
        raise KgenError(f"{path}: an entry's ranges are malformed ({one_line(repr(err), 80)}); run `kgen tune` again") from None
    if not ranges or ranges[0].lo != 1 or ranges[-1].hi is not None or any(
            a.hi is None or a.hi + 1 != b.lo for a, b in zip(ranges, ranges[1:])):
        raise KgenError(f"{path}: an entry's batch ranges do not cover 1.. without gaps; run `kgen tune` again")
    return ranges


def entry_dtype(e: dict) -> str:
    """The dtype whose plans an entry measured (float32 where it does not say)."""
    return e.get("dtype", "float32")


def _in(dtype: str) -> str:
    return "" if dtype == "float32" else f" in {dtype}"


def _shown(path: Path) -> str:
    return os.path.relpath(path) if path.is_absolute() else str(path)


def spec_entry(pipe, target) -> tuple[dict | None, list[str]]:
    """The stored entry of ``pipe``'s tuning file for ``target`` and the pipeline's dtype while the spec
    is unchanged (read once: ``eager_conv_tf32`` and ``applicable_entry`` take it), or None and a note on
    why none applies (another device, a changed spec; none where the dtype was never tuned)."""
    path = path_for(pipe.path)
    data = read(path)
    if data is None:
        return None, []
    shown = _shown(path)
    mine = [e for e in data["entries"] if entry_dtype(e) == pipe.dtype]
    if not mine and pipe.dtype != "float32":
        return None, []
    devices = [e.get("device") for e in mine]
    entry = next((e for e in mine if e.get("device") == target.name), None)
    if entry is None:
        return None, [f"{shown}: tuned{_in(pipe.dtype)} on {', '.join(map(str, devices)) or 'nothing'}, not on "
                      f"{target.name}: ignored"]
    if entry.get("spec_hash") != spec_hash(pipe):
        return None, [f"{shown}: stale for {target.name}{_in(pipe.dtype)}: the spec changed since it was tuned "
                      "(run `kgen tune`): ignored"]
    return entry, []


def tuned(stored: dict | None) -> bool:
    """Whether ``spec_entry``'s entry holds measured plans (not only eager's precision: `kgen tune --precision-only`)."""
    return stored is not None and "candidates" in stored


def applicable_entry(stored: dict | None, pipe, target, cand_hash: str) -> tuple[Entry | None, list[str]]:
    """``spec_entry``'s entry, if kgen's candidates are still those it was tuned among, and a note
    where they are not."""
    if not tuned(stored):
        return None, []
    path = path_for(pipe.path)
    if stored.get("candidates_hash") != cand_hash:
        return None, [f"{_shown(path)}: stale for {target.name}{_in(pipe.dtype)}: kgen's candidates for this spec changed "
                      "since it was tuned (run `kgen tune`): ignored"]
    return Entry(path, target.name, _ranges(path, stored), stored, entry_dtype(stored)), []


def eager_conv_tf32(stored: dict | None, pipe) -> tuple[tuple[str, bool], ...]:
    """What `kgen tune` measured of eager's convolutions (per convolution module, whether eager's cuDNN
    call runs TF32) in ``spec_entry``'s entry: a fact about eager PyTorch on that GPU, so it holds even
    where the entry's plans went stale. The planner sets it on the pipeline before it makes the
    candidates (Pipeline.eager_conv_tf32)."""
    record = (stored or {}).get("eager_conv_tf32", {})
    if not isinstance(record, dict) or not all(isinstance(k, str) and isinstance(v, bool) for k, v in record.items()):
        raise KgenError(f"{path_for(pipe.path)}: an entry's eager_conv_tf32 is not a map of module to true/false; "
                        "run `kgen tune` again")
    return tuple(sorted(record.items()))


def measured(entry: Entry) -> dict[str, dict[int, float]]:
    """Measured times of an entry's candidates: json of their choices -> {batch: ms}."""
    return {json.dumps(c["choices"], sort_keys=True): {int(b): float(ms) for b, ms in c.get("measured_ms", {}).items()}
            for c in entry.data.get("candidates", [])}


def write_entry(spec_path, entry: dict) -> Path:
    """Store ``entry`` in the spec's tuning file, replacing the one for its device and dtype (a float32
    entry is stored without a "dtype" key, as before 16-bit tuning)."""
    path = path_for(spec_path)
    data = read(path) or {"format": FORMAT, "spec": str(spec_path), "entries": []}
    if entry.get("dtype") == "float32":
        entry = {k: v for k, v in entry.items() if k != "dtype"}
    key = (entry["device"], entry_dtype(entry))
    data["entries"] = [e for e in data["entries"] if (e.get("device"), entry_dtype(e)) != key] + [entry]
    order = {"float32": 0, "bfloat16": 1, "float16": 2}
    data["entries"].sort(key=lambda e: (str(e.get("device")), order.get(entry_dtype(e), 3)))
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise KgenError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def ranges_from(best: dict[int, str], prefer: int) -> list[tuple[int, int | None, int, str]]:
    """Batch ranges from the best candidate measured at each batch: (min, max, tuned_at,
    candidate). Neighbouring batches with the same best share a range, tuned at the
    measured batch nearest ``prefer`` (the spec's example); where the best changes, the
    boundary is the geometric mean of the two measured batches (times scale with the batch)."""
    batches = sorted(best)
    runs: list[list[int]] = []
    for b in batches:
        if runs and best[runs[-1][-1]] == best[b]:
            runs[-1].append(b)
        else:
            runs.append([b])
    out = []
    for i, run in enumerate(runs):
        lo = 1 if i == 0 else out[-1][1] + 1
        hi = None
        if i + 1 < len(runs):
            hi = min(max(run[-1], int((run[-1] * runs[i + 1][0]) ** 0.5)), runs[i + 1][0] - 1)
        tuned_at = min(run, key=lambda b: (abs(b - prefer), b))
        out.append((lo, hi, tuned_at, best[run[0]]))
    return out
