"""A full disk: `harness run` refuses a --out disk that clearly cannot hold the run; when the disk fills
anyway the matrix stops with one error naming the folder, the cells done keep their verdicts, and every
report file is either complete or not written (atomic writes). The disk is a small tmpfs (needs root
and mount; skipped otherwise)."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterator

import pytest

from harness.cli import main
from harness.core.jsonio import write_text_atomic
from harness.core.limits import REPORTS_MIN_BYTES, RUN_DIR_MIN_BYTES
from harness.core.verdict import ExitCode
from tests.conftest import mounted_tmpfs


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("harness: error:")]


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "index.html"
    target.write_text("old, complete")

    def fail_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(OSError):
        write_text_atomic(target, "new" * 1000)
    assert target.read_text() == "old, complete"
    assert [p.name for p in tmp_path.iterdir()] == ["index.html"]  # the temporary file is gone


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1600 KiB tmpfs: room for the reports and one tiny run folder, not two."""
    with mounted_tmpfs(tmp_path / "disk", "1600k") as mnt:
        yield mnt


def _argv(tmp_path: Path, out: Path, topo: str, workload: str = "prompts") -> list[str]:
    return ["run", "--suite", "dcp", "--model", "tiny-gqa", "--topo", topo, "--out", str(out),
            "--workload", workload, "--cache-dir", str(tmp_path / "cache")]


def test_too_little_free_space_is_refused_before_the_run(tmp_path: Path, tiny_disk: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    topos = "tp2,tp4,tp2dcp2,tp4dcp2"  # 4 cells need >= 4 run folders: more than the disk holds
    out = tiny_disk / "out"
    assert main(_argv(tmp_path, out, topos)) == ExitCode.USAGE
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    need = 4 * RUN_DIR_MIN_BYTES + REPORTS_MIN_BYTES
    assert str(out) in lines[0] and "bytes free" in lines[0] and str(need) in lines[0], lines[0]
    assert not out.exists() and not (tmp_path / "cache" / "runs").exists()


def test_disk_filling_during_the_run_keeps_the_verdicts(tmp_path: Path, tiny_disk: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tiny_disk / "out"
    # passes the lower-bound check; the second launch fills the disk; each launch holds two workload cells
    code = main(_argv(tmp_path, out, "tp2,tp4", "prompts,concurrent"))
    captured = capsys.readouterr()
    lines = _error_lines(captured.err)
    assert code == ExitCode.ERROR, captured.err
    assert len(lines) == 1 and str(out) in lines[0] and "no space left on device" in lines[0], captured.err
    done, planned = map(int, re.search(r"the (\d+) cell\(s\) done of (\d+)", lines[0]).groups())  # type: ignore
    assert planned == 4 and 2 <= done < planned, lines[0]
    first = captured.out.splitlines()
    assert any("tp2" in line and "PASS" in line for line in first), captured.out  # the finished cell's verdict
    leftovers = [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == [], leftovers
    if (out / "results.json").exists():  # written: complete, the first cell keeps its verdict
        doc = json.loads((out / "results.json").read_text())
        assert [c["status"] for c in doc["cells"]][:2] == ["PASS", "PASS"], doc["cells"]
        # every planned cell is listed: those the full disk kept from running as not run
        assert len(doc["cells"]) == planned
        assert sum(c["checks"][0]["name"] == "not_run" for c in doc["cells"]) == planned - done
    if (out / "index.html").exists():
        assert (out / "index.html").read_text().rstrip().endswith("</html>")
    if (out / "junit.xml").exists():
        ET.parse(out / "junit.xml")
    if (out / "summary.md").exists():
        assert (out / "summary.md").read_text().endswith("\n")
