"""Multi-node cells on one machine: two harness agents rendezvous on 127.0.0.1 (tp4dcp2 as 2 nodes x
2 ranks); verdicts equal the single-node run's, and a fault injected in it FAILs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.launcher.nodes import parse_nodes

CELL = ["--suite", "dcp", "--topo", "tp4dcp2", "--model", "tiny-gqa", "--workload", "prompts"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(tmp: Path, name: str, cache: Path, extra: list[str]) -> tuple[int, int, Path]:
    """Node 1 as a separate harness process, node 0 in this one; (node 0 exit, node 1 exit, node 0 out)."""
    port = _free_port()
    common = [*CELL, *extra, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--cache-dir", str(cache)]
    with open(tmp / f"{name}-node1.log", "wb") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "harness", "run", *common, "--node-rank", "1",
                                  "--out", str(tmp / f"{name}-node1")], stdout=log, stderr=subprocess.STDOUT)
        try:
            code0 = main(["run", *common, "--node-rank", "0", "--out", str(tmp / f"{name}-node0")])
            code1 = node1.wait(timeout=1200)
        finally:
            if node1.poll() is None:
                node1.kill()
    return code0, code1, tmp / f"{name}-node0"


def _verdicts(out: Path) -> list[tuple[str, str, str]]:
    doc = json.loads((out / "results.json").read_text())
    return [(c["topology"], k["name"], k["verdict"]) for c in doc["cells"] for k in c["checks"]]


@pytest.fixture(scope="module")
def cache(shared_cache: Path) -> Path:
    return shared_cache


@pytest.mark.timeout(1500)  # three 4-rank launches on a shared 2-core machine
def test_two_agents_match_the_single_node_run(tmp_path: Path, cache: Path) -> None:
    assert main(["run", *CELL, "--out", str(tmp_path / "single"), "--cache-dir", str(cache)]) == 0
    code0, code1, out = _two_nodes(tmp_path, "clean", cache, [])
    assert (code0, code1) == (0, 0), (tmp_path / "clean-node1.log").read_text()[-2000:]
    assert _verdicts(out) == _verdicts(tmp_path / "single")
    assert json.loads((out / "results.json").read_text())["provenance"]["nnodes"] == 2
    assert not (tmp_path / "clean-node1" / "results.json").exists()  # only node 0 writes results
    job_dir = out / "runs" / "tiny-gqa" / "tp4dcp2" / "seed0" / "torchrun"
    assert sorted({p.parent.name for p in job_dir.glob("**/attempt_*/*/stdout.log")}) == ["0", "1"]


@pytest.mark.timeout(1500)
def test_a_fault_in_a_two_node_cell_fails(tmp_path: Path, cache: Path) -> None:
    code0, code1, out = _two_nodes(tmp_path, "fault", cache, ["--fault", "dcp-lse-merge"])
    assert (code0, code1) == (1, 0)
    verdicts = dict(((t, n), v) for t, n, v in _verdicts(out))
    assert verdicts[("tp4dcp2", "logits_decode")] == "FAIL"


@pytest.mark.parametrize("nnodes,rank,endpoint,match", [
    (2, 0, None, "needs --rdzv-endpoint"),
    (2, 2, "h:29400", "--node-rank 2"),
    (0, 0, None, "--nnodes 0"),
    (2, 1, "nohost", "not HOST:PORT"),
    (2, 1, "h:70000", "not HOST:PORT"),
    (1, 0, "h:29400", "needs --nnodes > 1"),
])
def test_bad_node_arguments(nnodes: int, rank: int, endpoint: str | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_nodes(nnodes, rank, endpoint)


def test_node_args_split_world_and_ports() -> None:
    nodes = parse_nodes(2, 1, "10.0.0.1:29400", cells=3)
    assert nodes is not None and nodes.spans(4) and not nodes.spans(3)
    args = nodes.launch(2).torchrun_args(8)
    assert "--nproc-per-node=4" in args and "--node-rank=1" in args and "--rdzv-endpoint=10.0.0.1:29402" in args
