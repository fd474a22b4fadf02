"""Every launched process gets cores // processes threads (a setting overrides), so ranks never
oversubscribe the machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.launcher.launch import THREADS_ENV, available_cores, thread_env, threads_per_process
from tests.conftest import launch_run


@pytest.mark.parametrize(("processes", "cores", "expected"), [(1, 2, 2), (2, 2, 1), (4, 2, 1), (3, 16, 5), (4, 16, 4)])
def test_threads_divide_cores_among_processes(processes: int, cores: int, expected: int) -> None:
    assert threads_per_process(processes, cores) == expected


def test_override_wins_and_bad_override_is_a_config_error() -> None:
    assert threads_per_process(4, 2, "3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match=THREADS_ENV):
            threads_per_process(1, 2, bad)
    assert thread_env(1, {THREADS_ENV: "1"}) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                                 "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env(2, {})["OMP_NUM_THREADS"] == str(max(1, available_cores() // 2))


def test_idle_openmp_threads_sleep_unless_the_user_says_otherwise() -> None:
    assert thread_env(1, {})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert thread_env(1, {"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"


def test_launched_rank_runs_with_the_set_thread_count(tmp_path: Path) -> None:
    # both launches fork from the same warm forkserver: the count is set per launch, not at its start
    for n in (1, 2):
        art = launch_run(tmp_path / f"threads{n}", "tiny-gqa", "tp1", env={THREADS_ENV: str(n)})
        assert art.ok
        assert art.manifest["threads_per_rank"] == n
