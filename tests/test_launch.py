"""A crashed or hung rank ends its launch (bounded by the launch and collective timeouts, not by a
wall-clock assertion: the tests must pass on a loaded machine), with every rank's log tail recorded
and the root cause's error line in the error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.backends.embedded.backend import WORKER_MODULE
from harness.backends.embedded.worker import INJECT_ENV
from harness.core.jsonio import write_json
from harness.formats.locate import load_model
from harness.launcher import forkserver
from harness.launcher.launch import LAUNCHER_ENV, descendants, thread_env
from harness.launcher.orphans import GUARD_POLL_S
from harness.records.artifacts import read_run
from harness.records.contract import Job
from harness.specs.topology import parse_topology_name
from tests.conftest import TEST_PROMPTS, launch_run
from tests.test_cli_signals import processes_naming


def test_crashed_rank_is_an_error_with_log_tails(tmp_path: Path) -> None:
    art = launch_run(tmp_path / "crash", "tiny-gqa", "tp2", env={INJECT_ENV: "crash:1"}, timeout_s=300)
    assert not art.ok
    assert art.manifest["error"].startswith("rank 1 exited with code 17; the launcher stopped the other ranks")
    # the reason names the rank that failed first and its error, not rank 0's broken-pipe follow-up
    assert art.manifest["error"].endswith("; rank1: injected failure: crash on rank 1")
    tails = art.manifest["log_tails"]
    assert "injected failure: crash on rank 1" in tails["rank1"]
    assert set(tails) >= {"rank0", "rank1", "launcher"}


def test_killed_rank_is_named_with_its_signal(tmp_path: Path) -> None:
    """kill -9 of rank 1: the reason names the rank and the signal, not only the launch's exit code."""
    art = launch_run(tmp_path / "kill", "tiny-gqa", "tp2", env={INJECT_ENV: "kill:1"}, timeout_s=300)
    assert not art.ok
    assert art.manifest["error"].startswith("rank 1 was killed by SIGKILL (exit code 137)"), art.manifest["error"]


def test_stopped_rank_is_named_not_the_rank_that_waited_for_it(tmp_path: Path) -> None:
    """kill -STOP of rank 1: rank 0 gives up first at the collective timeout, but the reason names rank 1."""
    art = launch_run(tmp_path / "stop", "tiny-gqa", "tp2", env={INJECT_ENV: "stop:1"}, timeout_s=300,
                     collective_timeout_s=3)
    error = art.manifest["error"]
    assert not art.ok and error.startswith("rank 1 never arrived at a collective (hung, stopped or dead)"), error
    assert "waiting for member 1 of 2 (rank 1" in error


def test_launch_timeout_says_how_long_and_which_logs_are_empty(tmp_path: Path) -> None:
    """A launch killed by its timeout says so, with the time, the setting, and how many rank logs are empty."""
    art = launch_run(tmp_path / "slow", "tiny-gqa", "tp2", env={INJECT_ENV: "hang:1"}, timeout_s=3,
                     collective_timeout_s=60)
    error = art.manifest["error"]
    assert not art.ok and error.startswith("killed after ") and "by the launch timeout (--timeout 3)" in error, error


def test_hung_rank_ends_the_launch(tmp_path: Path) -> None:
    art = launch_run(tmp_path / "hang", "tiny-gqa", "tp2", env={INJECT_ENV: "hang:1"}, timeout_s=300,
                     collective_timeout_s=5)
    assert not art.ok
    assert "injected failure: hang on rank 1" in art.manifest["log_tails"]["rank1"]


def test_fork_launcher_and_torchrun_give_the_same_run(tmp_path: Path) -> None:
    """The fork launcher (the default on CPU) against torchrun: the same job, bit-identical tensors, the
    per-rank logs in the launcher's folder."""
    runs = {name: launch_run(tmp_path / name, "tiny-gqa", "tp2dcp2", env={LAUNCHER_ENV: name})
            for name in ("fork", "torchrun")}
    fork, torchrun = runs["fork"], runs["torchrun"]
    assert fork.ok and torchrun.ok
    assert sorted(fork.tensors) == sorted(torchrun.tensors)
    assert all(torch.equal(fork.tensors[k], torchrun.tensors[k]) for k in fork.tensors)
    assert sorted(p.name for p in (tmp_path / "fork" / "ranks").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert sorted(p.parent.name for p in (tmp_path / "torchrun" / "torchrun").glob("**/attempt_*/*/stdout.log")) \
        == ["0", "1"]


def test_sigterm_to_the_fork_launcher_stops_every_rank(tmp_path: Path) -> None:
    """`kill PID` of the launcher alone (as a process manager stops `harness serve`): it passes the signal
    on to its ranks, reaps them and exits 128 + SIGTERM; no rank is left running."""
    job = Job(model=load_model("tiny-gqa"), topology=parse_topology_name("tp2"),
              prompts=TEST_PROMPTS, out_dir=str(tmp_path / "run"), max_new_tokens=4, collective_timeout_s=300)
    write_json(tmp_path / "job.json", job.to_dict())
    proc = subprocess.Popen([sys.executable, "-m", "harness.launcher.forkrun", "--nproc=2",
                             f"--log-dir={tmp_path / 'ranks'}", f"--module={WORKER_MODULE}", "--",
                             str(tmp_path / "job.json")],
                            env={**os.environ, INJECT_ENV: "hang:1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "injected failure: hang on rank 1" not in _read(tmp_path / "ranks" / "rank1.log"):
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 never reached its hang"
            time.sleep(0.2)
        ranks = descendants(proc.pid)
        assert len(ranks) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert [pid for pid in ranks if Path(f"/proc/{pid}").exists()] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_warm_launch_runs_in_the_callers_folder_with_its_environment(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch forked from the forkserver (started earlier, elsewhere) resolves a relative run folder
    against the caller's current folder and sees the launch's environment (here: a crash injection)."""
    assert launch_run(tmp_path / "first", "tiny-gqa", "tp2").ok  # the forkserver is up
    monkeypatch.chdir(tmp_path)
    assert launch_run(Path("relative"), "tiny-gqa", "tp2").ok
    assert (tmp_path / "relative" / "manifest.json").exists() and (tmp_path / "relative" / "ranks").is_dir()
    crashed = launch_run(Path("crashed"), "tiny-gqa", "tp1", env={INJECT_ENV: "crash:0"})
    assert not crashed.ok and "injected failure: crash on rank 0" in crashed.manifest["log_tails"]["rank0"]


def test_a_launch_with_another_openmp_wait_policy_starts_fresh(tmp_path: Path) -> None:
    """OpenMP reads its wait policy once, when torch loads: a launch asking for another policy than the
    forkserver's is started as a fresh interpreter, and runs alike."""
    assert launch_run(tmp_path / "first", "tiny-gqa", "tp2").ok
    policy = thread_env(1, dict(os.environ))["OMP_WAIT_POLICY"]  # what the forkserver started with
    other = "ACTIVE" if policy != "ACTIVE" else "PASSIVE"
    assert forkserver.usable({"OMP_WAIT_POLICY": policy}) and not forkserver.usable({"OMP_WAIT_POLICY": other})
    fresh = launch_run(tmp_path / "fresh", "tiny-gqa", "tp2", env={"OMP_WAIT_POLICY": other})
    first = read_run(tmp_path / "first")
    assert fresh.ok and all(torch.equal(fresh.tensors[k], first.tensors[k]) for k in first.tensors)


STDIN_SCRIPT = """
import sys
from harness.cli import main
from harness.launcher import forkserver
print("warm launches:", forkserver.main_preparable())
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_from_a_script_on_standard_input_launches_fresh_and_passes(tmp_path: Path, shared_cache: Path) -> None:
    """A script read from standard input (`python - ARGS`) names its main file '<stdin>', which a forkserver's child
    cannot run again before its target: its launches start as fresh interpreters, and its cells run (forked warm,
    every launch failed at once with an empty rank log)."""
    argv = [sys.executable, "-", "run", "--suite", "dcp", "--topo", "tp2", "--model", "tiny-gqa", "--workload",
            "prompts", "--seed", "0", "--out", str(tmp_path / "out"), "--cache-dir", str(shared_cache)]
    proc = subprocess.run(argv, input=STDIN_SCRIPT, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "warm launches: False" in proc.stdout and "SHIPPABLE" in proc.stdout
    assert forkserver.main_preparable()  # this test process (pytest, an xdist worker) forks its launches warm


def test_an_engine_server_forked_first_leaves_later_launches_warm(tmp_path: Path) -> None:
    """Whatever the harness forks first (here a `harness ...` engine-server command) starts the forkserver
    with the wait policy every launch asks for, so later launches are still forked warm."""
    script = f"""
import os, sys
os.environ.pop("OMP_WAIT_POLICY", None)
from pathlib import Path
from harness.backends.http.server import running_server
from harness.launcher import forkserver
from harness.launcher.launch import thread_env
with running_server([sys.executable, "-m", "harness", "--version"], {{}}, Path({str(tmp_path)!r}) / "server.log",
                    "http://127.0.0.1:9") as server:
    assert server.proc.wait(60) == 0
assert forkserver.usable(thread_env(2, dict(os.environ))), "the forkserver started with another wait policy"
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "server.log").read_text().startswith("harness ")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_no_process_of_the_harness_outlives_it(tmp_path: Path) -> None:
    """The warm forkserver (and every launch it forked) has exited by the time the harness process has."""
    marker = f"HARNESS_TEST_MARKER=outlive-{os.getpid()}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    log = tmp_path / "harness.log"
    with open(log, "wb") as out:  # a file, not a pipe: waiting for the process is not waiting for a pipe's EOF
        proc = subprocess.Popen([sys.executable, "-m", "harness", "run", "--suite", "dcp", "--topo", "tp2dcp2",
                                 "--model", "tiny-gqa", "--workload", "prompts", "--out", str(tmp_path / "r"),
                                 "--cache-dir", str(tmp_path / "c")], env=env, stdout=out, stderr=subprocess.STDOUT)
        assert proc.wait(timeout=600) == 0, log.read_text()[-2000:]
    # the run's guardian (harness/launcher/orphans.py, its own session so that it outlives a SIGKILL) notices the
    # run's end within its poll interval and exits: nothing of the harness is left after that
    deadline = time.monotonic() + 10 * GUARD_POLL_S
    while processes_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_naming(marker) == []
