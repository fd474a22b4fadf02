"""A crashed or hung rank ends its launch in bounded time, with every rank's log tail recorded."""

from __future__ import annotations

import time
from pathlib import Path

from harness.engine.worker import INJECT_ENV
from tests.conftest import launch_run


def test_crashed_rank_is_an_error_with_log_tails(tmp_path: Path) -> None:
    start = time.time()
    art = launch_run(tmp_path / "crash", "tiny-gqa", "tp2", env={INJECT_ENV: "crash:1"}, timeout_s=120)
    assert not art.ok
    assert time.time() - start < 100
    assert "exited with code" in art.manifest["error"]
    tails = art.manifest["log_tails"]
    assert "injected failure: crash on rank 1" in tails["rank1"]
    assert set(tails) >= {"rank0", "rank1", "launcher"}


def test_hung_rank_times_out_within_bound(tmp_path: Path) -> None:
    start = time.time()
    art = launch_run(tmp_path / "hang", "tiny-gqa", "tp2", env={INJECT_ENV: "hang:1"}, timeout_s=60,
                     collective_timeout_s=5)
    assert not art.ok
    assert time.time() - start < 75
    assert "injected failure: hang on rank 1" in art.manifest["log_tails"]["rank1"]
