"""A crashed or hung rank ends its launch (bounded by the launch and collective timeouts, not by a
wall-clock assertion: the tests must pass on a loaded machine), with every rank's log tail recorded
and the root cause's error line in the error."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.engine.worker import INJECT_ENV
from harness.launch import LAUNCHER_ENV
from tests.conftest import launch_run


def test_crashed_rank_is_an_error_with_log_tails(tmp_path: Path) -> None:
    art = launch_run(tmp_path / "crash", "tiny-gqa", "tp2", env={INJECT_ENV: "crash:1"}, timeout_s=300)
    assert not art.ok
    assert "exited with code" in art.manifest["error"]
    # the reason names the rank that failed first and its error, not rank 0's broken-pipe follow-up
    assert art.manifest["error"].endswith("; rank1: injected failure: crash on rank 1")
    tails = art.manifest["log_tails"]
    assert "injected failure: crash on rank 1" in tails["rank1"]
    assert set(tails) >= {"rank0", "rank1", "launcher"}


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
