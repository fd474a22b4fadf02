"""The matrix as data: `harness matrix` lines, `harness run --cells / --cells-from / --gpus`, `--shard env` from
each scheduler's variables, `--nnodes env` from an allocation, estimates from recorded launch times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.checks.settings import load_suite
from harness.cli import main
from harness.core.errors import ConfigError
from harness.launcher.nodes import first_host, nodes_from_env
from harness.records.cells import read_cells
from harness.records.shard import Shard, parse_shard, shard_from_env

CELL = ["--suite", "dcp", "--topo", "tp2dcp2", "--model", "tiny-gqa", "--seed", "0"]


@pytest.mark.parametrize("env, shard", [
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4"}, Shard(4, 4)),
    ({"SLURM_ARRAY_TASK_ID": "11", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "2"}, Shard(2, 2)),
    ({"JOB_COMPLETION_INDEX": "0", "HARNESS_SHARD_COUNT": "4"}, Shard(1, 4)),
    ({"BUILDKITE_PARALLEL_JOB": "2", "BUILDKITE_PARALLEL_JOB_COUNT": "3"}, Shard(3, 3)),
])
def test_shard_env_reads_each_scheduler(env: dict[str, str], shard: Shard) -> None:
    assert shard_from_env(env) == shard
    assert parse_shard("env", env) == shard


@pytest.mark.parametrize("env, words", [
    ({}, "no scheduler's shard variables"),
    ({"JOB_COMPLETION_INDEX": "1"}, "HARNESS_SHARD_COUNT is not"),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"}, "SLURM_ARRAY_TASK_ID=4 (min 0) of"),
    ({"BUILDKITE_PARALLEL_JOB": "x", "BUILDKITE_PARALLEL_JOB_COUNT": "2"}, "BUILDKITE_PARALLEL_JOB='x'"),
])
def test_shard_env_refuses_what_no_scheduler_set(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        shard_from_env(env)


def test_nodes_from_the_allocation() -> None:
    assert first_host("gpu[07-09,12],cpu1") == "gpu07" and first_host("node3,node4") == "node3"
    slurm = nodes_from_env({"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
                            "HARNESS_RDZV_PORT": "29500"})
    assert slurm is not None and (slurm.nnodes, slurm.node_rank, slurm.host, slurm.port) == (2, 1, "gpu07", 29500)
    jobset = nodes_from_env({"JOB_COMPLETION_INDEX": "0", "HARNESS_NNODES": "2",
                             "HARNESS_RDZV_HOST": "hm-nodes-0-0.hm"})
    assert jobset is not None and (jobset.node_rank, jobset.host, jobset.port) == (0, "hm-nodes-0-0.hm", 29400)
    assert nodes_from_env({"SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "a1"}) is None
    with pytest.raises(ConfigError, match="no allocation's variables"):
        nodes_from_env({})


def _matrix(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(["matrix", *argv]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_matrix_lines_say_what_each_cell_needs(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _matrix(capsys, "--suite", "dcp", "--topo", "tp2,tp4dcp2", "--seed", "0", "--seed", "1",
                    "--model", "tiny-gqa", "--gpus-per-node", "2")
    workloads = len(load_suite("dcp").workloads)
    assert len(lines) == 2 * 2 * workloads  # topologies x seeds x workloads
    assert len({c["id"] for c in lines}) == len(lines)
    tp4 = [c for c in lines if c["topology"] == "tp4dcp2"]
    assert {(c["gpus"], c["nodes"]) for c in tp4} == {(4, 2)}
    by_seed = {c["seed"]: c["reference"] for c in lines}  # one reference per (model, seed), shared by topologies
    assert {c["reference"] for c in lines} == set(by_seed.values()) and len(set(by_seed.values())) == 2
    assert all(c["estimate_source"] == "model" and c["estimate_s"] > 0 for c in lines)
    first = lines[0]
    assert first["id"] == "dcp/tiny-gqa/tp2/seed0/prompts" and first["launch"] == "dcp/tiny-gqa/tp2/seed0"
    assert first["command"].endswith("--topo tp2 --model tiny-gqa --seed 0 --workload prompts")
    assert {c["workload"] for c in lines} == set(load_suite("dcp").workloads)
    only = _matrix(capsys, "--suite", "dcp", "--topo", "tp2,tp4dcp2", "--seed", "0", "--model", "tiny-gqa",
                   "--gpus", "4")
    assert {c["topology"] for c in only} == {"tp4dcp2"}


def test_bad_cell_ids_are_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *CELL, "--cells", "dcp/tiny-gqa/tp8/seed0/prompts", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "harness: error: --cells: 'dcp/tiny-gqa/tp8/seed0/prompts' is not a cell of this run" in err
    bad = tmp_path / "cells.jsonl"
    bad.write_text('{"id": 1}\n')
    assert main(["run", *CELL, "--cells-from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"--cells-from {bad} line 1 is not a cell of `harness matrix`" in capsys.readouterr().err
    assert main(["run", *CELL, "--shard", "env", "--out", str(tmp_path / "o")]) == 2
    assert "--shard env: no scheduler's shard variables" in capsys.readouterr().err


def test_cells_from_runs_the_listed_cells_and_history_times_them(tmp_path: Path, shared_cache: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    lines = _matrix(capsys, *CELL)
    listed = tmp_path / "cells.jsonl"
    listed.write_text("".join(json.dumps(c) + "\n" for c in lines if c["workload"] in ("prompts", "lengths")))
    assert [c.workload for c in read_cells(listed)] == ["prompts", "lengths"]
    out, db = tmp_path / "run", tmp_path / "history.db"
    assert main(["run", *CELL, "--cells-from", str(listed), "--out", str(out), "--cache-dir", str(shared_cache),
                 "--history", str(db)]) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert [(c["workload"], c["status"]) for c in cells] == [("prompts", "PASS"), ("lengths", "PASS")]
    timed = _matrix(capsys, *CELL, "--history", str(db))
    assert {c["estimate_source"] for c in timed} == {"history"}
    assert timed[0]["estimate_s"] == pytest.approx(cells[0]["wall_s"], abs=0.01)


def test_shards_balance_by_the_cell_lists_estimates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --cells-from every share splits by the file's estimated seconds (a measured 100 s launch gets a share
    of its own), not by the cost model (which weighs tp4 over tp2)."""
    argv = ["--suite", "dcp", "--topo", "tp2,tp2dcp2,tp4,tp4dcp2", "--seed", "0", "--model", "tiny-gqa",
            "--workload", "prompts"]
    lines = _matrix(capsys, *argv)
    for line in lines:
        line["estimate_s"] = 100.0 if line["topology"] == "tp2" else 1.0
    listed = tmp_path / "cells.jsonl"
    listed.write_text("".join(json.dumps(c) + "\n" for c in lines))
    first = _matrix(capsys, *argv, "--cells-from", str(listed), "--shard", "1/2")
    second = _matrix(capsys, *argv, "--cells-from", str(listed), "--shard", "2/2")
    assert [c["topology"] for c in first] == ["tp2"]
    assert [c["topology"] for c in second] == ["tp2dcp2", "tp4", "tp4dcp2"]
    by_model = [c["topology"] for c in _matrix(capsys, *argv, "--shard", "1/2")]
    assert by_model != ["tp2"]  # the cost model alone splits otherwise
