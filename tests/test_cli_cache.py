"""`harness cache list|size|prune` on a cache filled by a real `harness run`."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from harness.cli import main

SUITE = """
name: cachetest
version: 1
models: [tiny-gqa]
topologies: [tp2]
max_new_tokens: 4
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is"]
checks: {layout: {}, logits: {}, generation: {}}
"""
DAY = 86400


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(suite file, cache folder) after one real run: the reference and its noise-floor twin."""
    tmp = tmp_path_factory.mktemp("cache-cli")
    suite = tmp / "cachetest.yaml"
    suite.write_text(SUITE)
    cache = tmp / "cache"
    assert main(["run", "--suite", str(suite), "--out", str(tmp / "out"), "--cache-dir", str(cache)]) == 0
    return suite, cache


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "runs").iterdir())


def _age(path: Path, days: float) -> None:
    t = time.time() - days * DAY
    os.utime(path, (t, t))


def test_list_and_size(filled: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, cache = filled
    names = _entries(cache)
    assert len(names) == 2  # float32 reference and its noise run
    capsys.readouterr()
    assert main(["cache", "--cache-dir", str(cache), "list"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in names) and "2 entries" in out
    assert main(["cache", "--cache-dir", str(cache), "size"]) == 0
    total = sum(p.stat().st_size for p in (cache / "runs").rglob("*") if p.is_file())
    assert f"({total} bytes)" in capsys.readouterr().out


def test_prune_by_age_keeps_used_entries_and_live_partials(tmp_path: Path, filled: tuple[Path, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    suite, shared = filled
    cache = tmp_path / "cache"
    shutil.copytree(shared, cache)
    old, recent = _entries(cache)
    _age(cache / "runs" / old, 30)
    _age(cache / "runs" / recent, 30)
    dead = cache / "runs" / f"x-tp1-float32-0123.{2**22 + 7}.partial"  # no such pid: abandoned
    live = cache / "runs" / f"y-tp1-float32-0123.{os.getpid()}.partial"  # this process: being written
    for p in (dead, live):
        p.mkdir()
        (p / "job.json").write_text("{}")
        _age(p, 30)
    # a run that takes `recent` from the cache marks it used, so prune keeps it
    assert main(["run", "--suite", str(suite), "--out", str(tmp_path / "out"), "--cache-dir", str(cache)]) == 0
    said = capsys.readouterr().out
    assert "cached" in said
    assert not dead.exists() and f"removed {dead.name}: its process is gone" in said  # swept at the lookup
    assert live.exists()
    dead.mkdir()  # abandoned again, after the run: prune deletes it
    (dead / "job.json").write_text("{}")
    _age(dead, 30)
    ages = {p.name: time.time() - p.stat().st_mtime for p in (cache / "runs").iterdir()}
    used = {n for n, a in ages.items() if a < DAY}
    assert used == {old, recent}  # the run used both: the reference and its noise-floor twin
    _age(cache / "runs" / old, 30)  # ... and `old` was not used after all

    assert main(["cache", "--cache-dir", str(cache), "prune", "--older-than", "7", "--dry-run"]) == 0
    assert "would delete" in capsys.readouterr().out and len(_entries(cache)) == 4
    assert main(["cache", "--cache-dir", str(cache), "prune", "--older-than", "7"]) == 0
    out = capsys.readouterr().out
    assert _entries(cache) == sorted([recent, live.name])
    assert f"deleted {old}" in out and f"deleted {dead.name}" in out


def test_prune_needs_a_positive_age(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["cache", "--cache-dir", str(tmp_path), "prune", "--older-than", "-3"])
    assert info.value.code == 2 and "--older-than" in capsys.readouterr().err


def test_empty_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "--cache-dir", str(tmp_path / "none"), "list"]) == 0
    assert "is empty" in capsys.readouterr().out


def test_gguf_conversions_and_exports_are_entries_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A converted GGUF (CACHE/gguf) and an HTTP export (CACHE/exports) are listed and pruned like runs."""
    cache = tmp_path / "cache"
    old, new = cache / "gguf" / "model-0123456789abcdef", cache / "exports" / "tiny-hd64-fedcba9876543210"
    for folder, days in ((old, 30), (new, 0)):
        folder.mkdir(parents=True)
        (folder / "weights.safetensors").write_bytes(b"x" * 1000)
        _age(folder, days)
    assert main(["cache", "--cache-dir", str(cache), "list"]) == 0
    out = capsys.readouterr().out
    assert "gguf/model-0123456789abcdef" in out and "exports/tiny-hd64-fedcba9876543210" in out
    assert main(["cache", "--cache-dir", str(cache), "prune", "--older-than", "7"]) == 0
    assert not old.exists() and new.exists()
