"""Bad input of the reliability issue, each one `harness: error:` line naming the bad value and what
would be valid, exit 2, no traceback, and nothing half-written left behind."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.paths import PROJECT_ROOT
from harness.core.verdict import ExitCode
from tests.report_fixtures import RESULTS_DIR

RANDOM_BYTES = bytes(range(128, 256)) * 3 + b"\x00\xff\xfe"  # not UTF-8 from the first byte on

# Runs the CLI with the `gguf` and `tokenizers` packages unimportable (a real ImportError: the [real]
# extra is not installed), without uninstalling them.
WITHOUT_REAL_EXTRA = """
import sys
class HideRealExtra:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("gguf", "tokenizers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, HideRealExtra())
from harness.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("harness: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _run_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["run", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), *extra]


def _nothing_ran(tmp_path: Path) -> None:
    assert not (tmp_path / "cache" / "runs").exists()
    assert not (tmp_path / "out").exists()


def test_random_bytes_suite_is_not_a_text_yaml_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "suite.yaml"
    suite.write_bytes(RANDOM_BYTES)
    assert main(_run_args(tmp_path, "--suite", str(suite))) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(suite) in line and "not a text YAML file" in line, line
    _nothing_ran(tmp_path)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_random_bytes_model_is_not_a_text_yaml_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    command: str) -> None:
    model = tmp_path / "model.yaml"
    model.write_bytes(RANDOM_BYTES)
    argv = (["plan", "--topo", "tp2"] if command == "plan" else _run_args(tmp_path, "--topo", "tp2"))
    assert main([*argv, "--model", str(model)]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(model) in line and "not a text YAML file" in line, line


@pytest.mark.parametrize("seed", ["-1", "-7", "x"])
def test_negative_seed_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_run_args(tmp_path, "--topo", "tp2", "--seed", seed))
    assert exc.value.code == ExitCode.USAGE
    line = _error_line(capsys)
    assert f"'{seed}'" in line and ">= 0" in line, line
    _nothing_ran(tmp_path)


@pytest.mark.parametrize("topo,words", [("", "empty topology list"), ("  ", "empty topology list"),
                                        (",", "empty topology list"), ("tp2,,tp4", "empty item"),
                                        ("tp2,", "empty item"), (",tp2", "empty item")])
def test_empty_topology_items_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], topo: str,
                                         words: str) -> None:
    assert main(_run_args(tmp_path, "--topo", topo)) == ExitCode.USAGE
    line = _error_line(capsys)
    assert words in line and repr(topo) in line and "comma" in line, line
    _nothing_ran(tmp_path)
    assert main(["plan", "--model", "tiny-gqa", "--topo", topo]) == ExitCode.USAGE
    assert words in _error_line(capsys)


def test_export_without_the_real_extra_says_what_to_install(tmp_path: Path) -> None:
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_REAL_EXTRA, "export", "--model", "tiny-gqa", "--out",
                           str(out)], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("harness: error:")]
    assert len(lines) == 1 and "pip install -e '.[real]'" in lines[0], proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # nothing half-written


def test_failed_export_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A failure after the weights are written (here: the tokenizer step) removes the staging folder."""
    import harness.formats.export as export

    def broken(spec: object, folder: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_tokenizer", broken)
    out = tmp_path / "exported"
    assert main(["export", "--model", "tiny-gqa", "--out", str(out)]) == ExitCode.ERROR
    capsys.readouterr()
    assert list(tmp_path.iterdir()) == []
    assert main(["plan", "--model", str(out), "--topo", "tp2"]) == ExitCode.USAGE  # nothing for plan to accept
    capsys.readouterr()


def test_export_into_an_existing_file_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    assert main(["export", "--model", "tiny-gqa", "--out", str(target)]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(target) in line and "file" in line and "folder" in line, line
    assert target.read_text() == "keep me"


def test_export_writes_a_complete_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["export", "--model", "tiny-gqa", "--out", str(out)]) == ExitCode.OK
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "generation_config.json"}
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]  # no staging folder left
    capsys.readouterr()


def test_validate_a_missing_path_says_it_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-run"
    assert main(["validate", str(missing)]) == ExitCode.USAGE
    line = _error_line(capsys)
    assert str(missing) in line and "does not exist" in line, line


def test_failed_history_add_leaves_no_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "history.db"
    assert main(["history", "add", str(tmp_path / "missing-run"), "--history", str(db)]) == ExitCode.USAGE
    assert "missing-run" in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_failed_history_add_leaves_the_database_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A good run folder then a broken one: neither is recorded (one transaction), the store is unchanged."""
    db = tmp_path / "history.db"
    assert main(["history", "add", str(RESULTS_DIR / "clean"), "--history", str(db)]) == ExitCode.OK
    before = sqlite3.connect(db).execute("SELECT COUNT(*) FROM checks").fetchone()[0]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "results.json").write_text("{not json")
    capsys.readouterr()
    argv = ["history", "add", str(RESULTS_DIR / "skip"), str(broken), "--history", str(db)]
    assert main(argv) == ExitCode.USAGE
    assert "broken" in _error_line(capsys)
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM checks").fetchone()[0] == before
    assert {p.name for p in tmp_path.iterdir()} == {"history.db", "broken"}
