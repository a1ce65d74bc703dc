"""kgen's cache (kgen.cache, `kgen cache`): its entries and their last use, the precompiled headers pruned when a
new one is made, and the command that shows and clears it."""
import os
import time

from conftest import kgen_cli
from kgen import cache

DAY = 86400


def _entry(root, kind, name, age_s, size=1000):
    """A cache entry made ``age_s`` seconds ago (its last use), holding ``size`` bytes."""
    d = root / kind / name
    d.mkdir(parents=True)
    (d / "data").write_bytes(b"x" * size)
    (root / kind / f"{name}.lock").touch()
    t = time.time() - age_s
    os.utime(d, (t, t))
    return d


def test_entries_are_listed_least_recently_used_first_with_their_sizes(tmp_path):
    _entry(tmp_path, "compiled", "net-a", 3 * DAY, 2000)
    _entry(tmp_path, "compiled", "net-b", 1 * DAY)
    _entry(tmp_path, "pch", "p1", 2 * DAY, 5000)
    (tmp_path / "compiled" / "tmp-net-c-123").mkdir()  # one being rendered: not an entry yet
    found = cache.entries(tmp_path)
    assert [(e.kind, e.path.name, e.size) for e in found] == [("compiled", "net-a", 2000), ("pch", "p1", 5000),
                                                              ("compiled", "net-b", 1000)]
    cache.mark_used(found[0].path)
    assert cache.entries(tmp_path)[-1].path.name == "net-a"


def test_pruning_keeps_the_last_used_headers_and_any_used_within_the_hour(tmp_path):
    for i, age in enumerate([5 * DAY, 4 * DAY, 3 * DAY, 600, 2 * DAY]):
        _entry(tmp_path, "pch", f"p{i}", age)
    compiled = _entry(tmp_path, "compiled", "net-a", 9 * DAY)
    stray, fresh = tmp_path / "pch" / "failed.lock", tmp_path / "pch" / "making.lock"  # no entry: a failed one,
    stray.touch()                                                                       # and one being made
    os.utime(stray, (time.time() - DAY, time.time() - DAY))
    fresh.touch()
    # seen from a minute after the oldest use, every header was used within the hour: none goes
    assert cache.prune_precompiled_headers(keep=1, root=tmp_path, now=time.time() - 5 * DAY + 60) == []
    removed = cache.prune_precompiled_headers(keep=1, root=tmp_path)
    assert sorted(e.path.name for e in removed) == ["p0", "p1", "p2", "p4"]  # all but the last used, with their locks
    left = sorted(p.name for p in (tmp_path / "pch").iterdir())
    assert left == ["making.lock", "p3", "p3.lock"], left
    assert compiled.is_dir()  # compiled entries are never pruned on their own


def test_the_command_shows_the_cache_and_removes_what_was_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_CACHE", str(tmp_path))
    _entry(tmp_path, "compiled", "net-old", 40 * DAY, 3 * 2**20)
    _entry(tmp_path, "compiled", "net-new", 60)
    _entry(tmp_path, "pch", "p1", 100, 2**20)
    r = kgen_cli("cache")
    rc, out, err = r.returncode, r.stdout, r.stderr
    assert rc == 0, err
    assert str(tmp_path) in out
    assert [line.split()[:2] for line in out.splitlines()[3:]] == [["compiled", "2"], ["pch", "1"]]
    assert "3.0 MB" in out and "1.0 MB" in out
    r = kgen_cli("cache", "--older-than", "30")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "removed 1 of 3 entries (3.0 MB)" in out
    assert sorted(p.name for p in (tmp_path / "compiled").iterdir()) == ["net-new", "net-new.lock"]
    (tmp_path / "pch" / "gone.lock").touch()  # a lock whose entry is not there
    (tmp_path / cache.DYNAMIC_BATCH_FILE).write_text("{}")  # the backend's frames asked dynamic: --clear forgets them
    r = kgen_cli("cache", "--clear")
    assert r.returncode == 0 and "removed 2 of 2 entries" in r.stdout, r
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    r = kgen_cli("cache", "--older-than", "-1")
    assert r.returncode != 0 and "-1" in r.stdout + r.stderr
