"""Ordinary input a release manager or a new user gives, each met with one `harness: error:` line (exit 2) or the
right cell, never a traceback: names that would become paths outside --out / --cache-dir, output paths that are
files, results that are not UTF-8, a history on a read-only disk, reports into a full disk, a serve engine without
its extra, a bad HARNESS_SHM_COLLECTIVES, failed reference launches (no *.partial left in the cache), and the
smaller ones (plan --tokens, cache / history paths of the wrong kind, a server that dies mid-run, HTML in names)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from harness.cli import main
from harness.core.errors import ConfigError
from harness.core.paths import MODELS_DIR, PROJECT_ROOT, SUITES_DIR
from harness.core.verdict import ExitCode
from harness.formats.locate import load_model
from harness.specs.engine import load_engine
from harness.specs.topology import load_catalog
from tests.conftest import mounted_tmpfs
from tests.report_fixtures import RESULTS_DIR

NOT_UTF8 = b'{"schema_version": 1, "run_id": "\xff\xfe", "cells": []}'


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("harness: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _model_file(folder: Path, name: str) -> Path:
    data = yaml.safe_load((MODELS_DIR / "tiny-gqa.yaml").read_text())
    data["name"] = name
    path = folder / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# -- item 2: every name that becomes a path is one path component, checked where specs are loaded --------------

@pytest.mark.parametrize("name", ["../../../escaped", "org/model", "", ".hidden", "a\nb", "..", "back\\slash"])
def test_a_model_name_that_is_not_one_path_component_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 name: str) -> None:
    deep = tmp_path / "a" / "b" / "c"
    model = _model_file(tmp_path, name)
    argv = ["run", "--suite", "dcp", "--topo", "tp2", "--model", str(model), "--out", str(deep / "out"),
            "--cache-dir", str(deep / "cache"), "--engine", "embedded"]
    assert main(argv) == ExitCode.USAGE
    line = _error_line(capsys)
    assert repr(name) in line and "one path component" in line, line
    if name == "org/model":
        assert "'org--model'" in line, line  # the name it could be
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.yaml"]  # nothing written anywhere
    with pytest.raises(ConfigError, match="one path component"):
        load_model(str(model))


def test_a_suite_engine_or_topology_name_that_is_a_path_is_refused(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    suite = yaml.safe_load((SUITES_DIR / "dcp.yaml").read_text())
    suite["name"] = "../../escaped-suite"
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    assert main(["run", "--suite", str(tmp_path / "suite.yaml"), "--topo", "tp2", "--cache-dir",
                 str(tmp_path / "cache"), "--engine", "no-such-engine"]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert "'../../escaped-suite'" in line and "one path component" in line, line

    engine = yaml.safe_load((PROJECT_ROOT / "engines" / "harness-serve.yaml").read_text())
    engine["name"] = "../escaped-engine"
    (tmp_path / "engine.yaml").write_text(yaml.safe_dump(engine))
    with pytest.raises(ConfigError, match="'../escaped-engine'.*one path component"):
        load_engine(str(tmp_path / "engine.yaml"))

    topologies = tmp_path / "topologies"
    topologies.mkdir()
    (topologies / "t.yaml").write_text("topologies:\n  ../up: {tp: 2}\n")
    with pytest.raises(ConfigError, match="'../up'.*one path component"):
        load_catalog((topologies,))


# -- item 8: no traceback on ordinary input ---------------------------------------------------------------------

def test_signoff_out_that_is_a_file_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    argv = ["signoff", "--candidate", str(RESULTS_DIR / "clean"), "--baseline", str(RESULTS_DIR / "corruption"),
            "--out", str(blocker)]
    assert main(argv) == ExitCode.USAGE
    line = _error_line(capsys)
    assert f"--out {blocker}" in line and "file" in line, line
    assert blocker.read_text() == "x"


def _not_utf8_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_bytes(NOT_UTF8)
    return run


@pytest.mark.parametrize("command", ["report", "signoff", "history", "baseline"])
def test_a_results_file_that_is_not_utf8_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       command: str) -> None:
    run = _not_utf8_run(tmp_path)
    argv = {"report": ["report", str(run), "--out", str(tmp_path / "out")],
            "signoff": ["signoff", "--candidate", str(run), "--baseline", str(RESULTS_DIR / "clean"), "--out",
                        str(tmp_path / "out")],
            "history": ["history", "add", str(run), "--history", str(tmp_path / "history.db")],
            "baseline": ["baseline", "update", "--from", str(run), "--yes", "--dir", str(tmp_path / "baselines")],
            }[command]
    assert main(argv) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(run / "results.json") in line and "UTF-8" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written


def test_history_add_to_an_unwritable_path_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for db in (blocker / "history.db", Path("/proc/harness-no-history.db")):
        assert main(["history", "add", str(RESULTS_DIR / "clean"), "--history", str(db)]) == ExitCode.USAGE
        line = _error_line(capsys)
        assert f"history {db}" in line and "cannot" in line, line


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs (needs root and mount; skipped otherwise), unmounted after the test."""
    with mounted_tmpfs(tmp_path / "disk", "512k") as mnt:
        yield mnt


def test_history_add_on_a_read_only_file_system_is_one_error(tmpfs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmpfs / "history.db"
    assert main(["history", "add", str(RESULTS_DIR / "clean"), "--history", str(db)]) == ExitCode.OK
    before = db.read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    capsys.readouterr()
    assert main(["history", "add", str(RESULTS_DIR / "error"), "--history", str(db)]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(db) in line and "read-only" in line, line
    assert db.read_bytes() == before
    assert main(["history", "show", "--history", str(db)]) == ExitCode.OK  # still readable


def test_report_into_a_full_disk_is_one_error(tmpfs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    filler = tmpfs / "filler"
    with open(filler, "wb") as f:  # fill the disk up
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    out = tmpfs / "report"
    assert main(["report", str(RESULTS_DIR / "clean"), "--out", str(out)]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(out) in line and "No space left on device" in line, line
    assert not [p for p in tmpfs.rglob("*.tmp")]


# -- item 9: configuration errors found before any work starts --------------------------------------------------

WITHOUT_SERVE_EXTRA = """
import sys
class HideServeExtra:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, HideServeExtra())
from harness.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_serve_extra(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_SERVE_EXTRA, *argv], capture_output=True, text=True,
                          cwd=PROJECT_ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})


def test_harness_serve_without_the_serve_extra_is_refused_before_any_cell(tmp_path: Path) -> None:
    proc = _without_serve_extra("run", "--suite", "dcp", "--topo", "tp2", "--model", "tiny-gqa", "--engine",
                                "harness-serve", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"))
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("harness: error:")]
    assert len(lines) == 1 and "fastapi" in lines[0] and "pip install -e '.[serve]'" in lines[0], proc.stderr
    assert not (tmp_path / "cache" / "runs").exists() and not (tmp_path / "out").exists()
    listed = _without_serve_extra("list", "engines")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith("harness-serve "))
    assert "unavailable" in line and "fastapi" in line and "'.[serve]'" in line, listed.stdout


def test_a_bad_shm_collectives_value_is_refused_before_any_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_SHM_COLLECTIVES", "2")
    argv = ["run", "--suite", "dcp", "--topo", "tp2", "--model", "tiny-gqa", "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == ExitCode.USAGE
    line = _error_line(capsys)
    assert "HARNESS_SHM_COLLECTIVES='2'" in line and "0" in line and "1" in line, line
    assert not (tmp_path / "cache" / "runs").exists() and not (tmp_path / "out").exists()


# -- item 12: the smaller ones -----------------------------------------------------------------------------------

def test_plan_with_a_huge_token_count_is_one_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "tiny-gqa", "--topo", "tp4dcp4", "--tokens", "100000000"]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert "--tokens 100000000" in line and "at most" in line, line
    assert capsys.readouterr().out == ""


def test_cache_dir_that_is_a_file_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for action in ("list", "size"):
        assert main(["cache", "--cache-dir", str(blocker), action]) == ExitCode.USAGE
        line = _error_line(capsys)
        assert f"--cache-dir {blocker}" in line and "file" in line, line


def test_history_show_of_a_folder_says_it_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "show", "--history", str(tmp_path)]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(tmp_path) in line and "is a folder" in line and "does not exist" not in line, line


def test_summary_escapes_html_in_names(tmp_path: Path) -> None:
    """A model, suite or run id holding HTML is text in summary.md: every '<' and '>' backslash-escaped (CommonMark:
    an escaped '<' never opens raw HTML), in the headline, the matrix and the problem lists alike."""
    import re
    from dataclasses import replace

    from harness.report import read_results, render_all
    evil = "<img src=x onerror=alert(1)>"
    cells = []
    for kind in ("clean", "corruption", "error", "skip"):
        found, provenance, _ = read_results(RESULTS_DIR / kind)
        cells += [replace(c, model=evil, suite=evil) for c in found]
    render_all(tmp_path, cells, {**provenance, "suite": evil}, evil)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("\\<img src=x onerror=alert(1)\\>") >= len(cells), summary
    assert not re.search(r"(?<!\\)[<>]", summary), summary


def test_shipped_specs_still_load() -> None:
    """The names of every shipped model, suite, engine and topology are valid path components."""
    from harness.specs.engine import shipped_engines
    from harness.specs.model import shipped_models
    from harness.specs.suite import read_suite, shipped_suites
    for name in shipped_models():
        load_model(name)
    for name in shipped_suites():
        read_suite(name)
    for name in shipped_engines():
        load_engine(name)
    load_catalog()


# -- item 11: a failed reference launch leaves no *.partial folder in the cache -----------------------------------

CRASHING_SERVER = "import sys; print('engine: ERROR out of cheese', flush=True); sys.exit(3)"


def _crashing_engine(tmp_path: Path) -> str:
    path = tmp_path / "crashing.yaml"
    path.write_text(yaml.safe_dump({"dialect": "vllm", "model_format": "spec", "supports_dcp": False,
                                    "argv": ["{python}", "-c", CRASHING_SERVER, "{port}"]}))
    return str(path)


def test_a_failed_reference_launch_leaves_no_partial_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.records.results import results_cells
    cache = tmp_path / "cache"
    argv = ["run", "--suite", "dcp", "--model", "tiny-gqa", "--topo", "tp2", "--workload", "prompts",
            "--engine", _crashing_engine(tmp_path), "--out", str(tmp_path / "out"), "--cache-dir", str(cache)]
    assert main(argv) == ExitCode.ERROR
    capsys.readouterr()
    assert not list((cache / "runs").glob("*.partial")), list((cache / "runs").iterdir())
    (cell,) = results_cells(tmp_path / "out")
    assert cell["status"] == "ERROR" and "out of cheese" in cell["error_log"], cell  # the log tail is kept
    assert cell["reference_dir"] == ""  # no folder that is not there


def test_stale_partial_folders_of_dead_processes_go_at_the_next_lookup(tmp_path: Path) -> None:
    from harness.backends.registry import get_backend
    from harness.flow.refcache import ReferenceCache, ReferenceFailed
    from harness.records.contract import Job
    from harness.specs.topology import parse_topology_name

    runs = tmp_path / "cache" / "runs"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = runs / f"tiny-gqa-tp1-float32-0123456789abcdef.{dead.pid}.partial"
    alive = runs / f"tiny-gqa-tp1-float32-fedcba9876543210.{os.getpid()}.partial"
    for folder in (stale, alive):
        folder.mkdir(parents=True)
        (folder / "rank0.log").write_text("half a run")
    said: list[str] = []
    cache = ReferenceCache(tmp_path / "cache", get_backend(_crashing_engine(tmp_path)), 60, said.append)
    job = Job(model=load_model("tiny-gqa"), topology=parse_topology_name("tp1"), prompts=["hi"], out_dir=".")
    with pytest.raises(ReferenceFailed, match="exited with code 3") as failed:
        cache.get(job, "tiny-gqa-tp1-float32", "reference")
    assert "out of cheese" in "".join(failed.value.log_tails.values())
    assert not stale.exists() and alive.exists()  # a live process's staging folder is its own
    assert sorted(p.name for p in runs.iterdir()) == [alive.name]
    assert any(stale.name in line and "process is gone" in line for line in said), said


# -- found by the fuzzing (tests/test_fuzz_inputs.py), kept as plain cases ----------------------------------------

def test_an_engine_template_with_a_stray_brace_is_one_config_error(tmp_path: Path) -> None:
    engine = yaml.safe_load((PROJECT_ROOT / "engines" / "harness-serve.yaml").read_text())
    engine["argv"] = [*engine["argv"], "max_logprobs}"]
    (tmp_path / "engine.yaml").write_text(yaml.safe_dump(engine))
    with pytest.raises(ConfigError, match="'max_logprobs}' is not a valid template"):
        load_engine(str(tmp_path / "engine.yaml"))


@pytest.mark.parametrize("dialect, answer", [("sglang", [{"text": ""}]), ("vllm", {"choices": [[1]]}),
                                             ("openai", {"choices": [{"logprobs": {"tokens": 5}}]})])
def test_a_malformed_server_answer_is_one_run_error(dialect: str, answer: object) -> None:
    from harness.backends.http.dialects import DIALECTS
    from harness.core.errors import RunError
    client = DIALECTS[dialect](lambda path, body: answer, "m")
    with pytest.raises(RunError, match=f"not a {dialect} dialect's answer"):
        client.score([[10, 11, 12]], k=2, together=True)


def test_a_damaged_history_database_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "history.db"
    assert main(["history", "add", str(RESULTS_DIR / "clean"), str(RESULTS_DIR / "error"), "--history",
                 str(db)]) == ExitCode.OK
    raw = bytearray(db.read_bytes())
    raw[len(raw) // 2:] = b"\x80" * (len(raw) - len(raw) // 2)  # the second half of its pages: not UTF-8, no tree
    db.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["history", "show", "--history", str(db)]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(db) in line, line
