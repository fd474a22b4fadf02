"""Mistakes a new user makes, each caught before anything runs: one `harness: error:` line naming the
bad value, exit 2, nothing launched (no run folder, no cache entry). A closed stdout pipe is a quiet exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.verdict import ExitCode

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    HAS_CUDA = False


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness: error:")]
    assert len(err) == 1, err
    return err[0]


def _nothing_ran(tmp_path: Path) -> None:
    assert not (tmp_path / "cache" / "runs").exists()
    assert not list(tmp_path.rglob("job.json"))


def _run(tmp_path: Path, *extra: str) -> list[str]:
    base = {"--out": str(tmp_path / "out"), "--cache-dir": str(tmp_path / "cache")}
    for flag in extra[::2]:
        base.pop(flag, None)
    return ["run", "--suite", "dcp", "--topo", "tp2", *[x for kv in base.items() for x in kv], *extra]


def _unwritable(tmp_path: Path) -> list[Path]:
    """Folders no process can create: under a regular file, and (Linux) under /proc, which refuses
    even root (so the test does not depend on who runs it)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    paths = [blocker / "sub", blocker]
    if Path("/proc/self").is_dir():
        paths.append(Path("/proc/harness-cannot-write-here"))
    return paths


@pytest.mark.parametrize("flag", ["--out", "--cache-dir"])
def test_unwritable_folder_is_one_error_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             flag: str) -> None:
    for bad in _unwritable(tmp_path):
        assert main(_run(tmp_path, flag, str(bad))) == 2
        line = _error_line(capsys)
        assert f"{flag} {bad}" in line and ("folder" in line or "writable" in line), line
    _nothing_ran(tmp_path)


def test_read_only_folder_is_refused_for_an_ordinary_user(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; covered by the /proc case above")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    assert main(_run(tmp_path, "--out", str(ro / "report"))) == 2
    assert "not writable" in _error_line(capsys)


@pytest.mark.skipif(HAS_CUDA, reason="this torch has CUDA: --device cuda is valid here")
def test_cuda_without_cuda_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_run(tmp_path, "--device", "cuda")) == 2
    line = _error_line(capsys)
    assert "--device cuda" in line and "--device cpu" in line and "torch.cuda.is_available() is False" in line
    _nothing_ran(tmp_path)


@pytest.mark.parametrize(("flag", "value"), [
    ("--timeout", "-5"), ("--timeout", "0"), ("--timeout", "nan"), ("--timeout", "soon"),
    ("--collective-timeout", "-1"), ("--collective-timeout", "inf"),
    ("--kv-budget-mib", "0"), ("--max-seq-len", "-16"), ("--seed", "x"),
])
def test_bad_numbers_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str,
                                      value: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(_run(tmp_path, flag, value))
    assert info.value.code == 2
    line = _error_line(capsys)
    assert flag in line and value in line, line
    _nothing_ran(tmp_path)


def test_max_seq_len_counts_each_prompts_own_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The longest sequence of a run (a prompt's own tokens + what it generates, per workload) must fit a KV
    slot: the suite's prompts are counted by their tokens, not as empty; the error names it and the limit."""
    from harness.checks.settings import load_suite
    from harness.formats.locate import load_model
    from harness.formats.tokenizer import load_tokenizer

    suite, tokenizer = load_suite("dcp"), load_tokenizer(load_model("tiny-gqa"))
    longest = max(len(tokenizer.encode(p)) for p in suite.prompts) + suite.max_new_tokens
    assert longest > suite.max_new_tokens + 8
    code = main(_run(tmp_path, "--model", "tiny-gqa", "--workload", "prompts", "--max-seq-len", str(longest - 1)))
    assert code == 2
    line = _error_line(capsys)
    assert f"{longest} tokens" in line and f"max_seq_len={longest - 1}" in line and "workload prompts" in line, line
    _nothing_ran(tmp_path)
    # every workload of the run counts: the longest of them all is named (lengths: long_context + generation)
    assert main(_run(tmp_path, "--model", "tiny-gqa", "--max-seq-len", "8")) == 2
    line = _error_line(capsys)
    assert f"{suite.long_context + suite.max_new_tokens} tokens" in line and "workload lengths" in line, line
    _nothing_ran(tmp_path)


@pytest.mark.parametrize("argv", [
    ["--budget-gib", "nan"], ["--budget-gib", "-1"], ["--block-size", "0"], ["--max-seq-len", "-4"],
])
def test_plan_bad_numbers_are_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "tiny-gqa", "--topo", "tp2", *argv])
    assert info.value.code == 2
    assert argv[0] in _error_line(capsys)


@pytest.mark.parametrize("argv", [
    ["--suite", "dcp", "--topo", "tp3"],                     # tiny-gqa's heads do not split over 3
    ["--suite", "dcp", "--topo", "tp2", "--fault", "dcp-tp-kv-layot"],  # a typo in a fault name
    ["--suite", "dcp", "--topo", "tp2", "--model", "no-such-model"],
    ["--suite", "dcp", "--topo", "tp2", "--profile", "no-such-profile"],
    ["--suite", "gsm8k", "--topo", "tp3", "--gsm8k-path", "/nonexistent/gsm8k"],
])
def test_other_mistakes_are_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(["run", *argv, "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]) == 2
    _error_line(capsys)
    _nothing_ran(tmp_path)


@pytest.mark.parametrize(("var", "value"), [("HARNESS_LAUNCHER", "mpirun"), ("HARNESS_THREADS_PER_PROCESS", "0")])
def test_bad_launch_settings_are_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    assert main(["run", "--suite", "dcp", "--topo", "tp2", "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache")]) == 2
    line = _error_line(capsys)
    assert f"{var}={value!r}" in line
    _nothing_ran(tmp_path)


def test_report_into_unwritable_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.report import write_results
    write_results(tmp_path / "run", [], {}, "run")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["report", str(tmp_path / "run"), "--out", str(blocker / "merged")]) == 2
    assert "--out" in _error_line(capsys)


def test_closed_stdout_pipe_is_a_quiet_exit(tmp_path: Path) -> None:
    """`harness plan --format json | head -1`: the reader leaves; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "harness", "plan", "--model", "tiny-gqa", "--topo", "tp8dcp2",
                             "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the harness has written a byte: every write hits a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == ExitCode.BROKEN_PIPE
    assert err == ""


def test_launch_timeout_from_the_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.cli.run import TIMEOUT_ENV, launch_timeout
    monkeypatch.setenv(TIMEOUT_ENV, "77")
    assert launch_timeout(None) == 77.0 and launch_timeout(5.0) == 5.0
    monkeypatch.setenv(TIMEOUT_ENV, "-3")
    assert main(_run(tmp_path)) == 2
    assert TIMEOUT_ENV in _error_line(capsys)
    _nothing_ran(tmp_path)


def test_pytest_timeout_outlasts_the_launches_of_a_test() -> None:
    """A slow launch ends as the harness's own timeout (an ERROR with log tails), before pytest's."""
    import re

    from tests.conftest import TEST_LAUNCH_TIMEOUT_S, TEST_LAUNCHES_PER_TEST
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    per_test = int(re.search(r"^timeout = (\d+)$", pyproject.split("[tool.pytest.ini_options]")[1], re.M).group(1))
    assert per_test >= TEST_LAUNCHES_PER_TEST * TEST_LAUNCH_TIMEOUT_S
    assert float(os.environ["HARNESS_LAUNCH_TIMEOUT_S"]) <= TEST_LAUNCH_TIMEOUT_S
