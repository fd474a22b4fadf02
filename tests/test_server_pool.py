"""One engine server per engine configuration for a whole `harness run` (harness/backends/server_pool.py), over
the harness's own HTTP server (`--engine harness-serve`, real servers on loopback): the reference, its noise
twin and every cell of one configuration share a server; the verdicts equal those of a server per run; kept
servers (--keep-servers) are reused by the next run and stopped by a run without the flag; a server that dies
under a cell makes that cell an ERROR with its log, and the next run of its configuration gets a fresh one."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness.backends.server_pool import PID_FILE, STATE_FILE, pid_alive, stop_kept
from harness.cli import main
from harness.core.jsonio import read_json
from harness.flow.runner import CellPlan, serving_order
from harness.records.results import results_cells
from harness.specs.checkpoint import load_model
from harness.specs.topology import parse_topology_name

TP = ["run", "--suite", "tp", "--model", "tiny-gqa", "--engine", "harness-serve", "--topo", "tp2,tp4",
      "--max-seq-len", "128", "--kv-budget-mib", "8", "--workload", "prompts,concurrent"]


def _run(out: Path, cache: Path, *extra: str) -> dict[str, Any]:
    code = main([*TP, "--out", str(out), "--cache-dir", str(cache), *extra])
    provenance = read_json(out / "results.json")["provenance"]
    return {"exit": code, "cells": results_cells(out), "servers": provenance.get("servers", []), "out": out}


def _verdicts(run: dict[str, Any]) -> dict[tuple[str, int, str], dict[str, str]]:
    return {(c["topology"], c["seed"], c["workload"]): {k["name"]: k["verdict"] for k in c["checks"]}
            for c in run["cells"]}


def _served(run_dir: str) -> dict[str, Any]:
    return read_json(Path(run_dir) / "manifest.json")["server"]


def test_serving_order_puts_the_runs_of_one_configuration_together() -> None:
    """By model, weights (a seed reseeds a synthetic model's weights; a checkpoint's stay), tp/dcp (a -draft
    cell beside its plain one, whose server it shares), then seed."""
    synthetic = load_model("tiny-gqa")
    checkpoint = replace(synthetic, name="ckpt", source="hf", path="/ckpt")
    cells = [CellPlan(m, parse_topology_name(t), None, seed, None)
             for m in (synthetic, checkpoint) for seed in (0, 1) for t in ("tp2", "tp4", "tp2-draft")]
    assert [cells[i].slug for i in serving_order(cells)] == [
        "tiny-gqa/tp2/seed0", "tiny-gqa/tp2-draft/seed0", "tiny-gqa/tp4/seed0",
        "tiny-gqa/tp2/seed1", "tiny-gqa/tp2-draft/seed1", "tiny-gqa/tp4/seed1",
        "ckpt/tp2/seed0", "ckpt/tp2-draft/seed0", "ckpt/tp2/seed1", "ckpt/tp2-draft/seed1",
        "ckpt/tp4/seed0", "ckpt/tp4/seed1"]


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pooled")
    return _run(root / "out", root / "cache", "--seed", "0", "--seed", "1")


@pytest.mark.slow
@pytest.mark.xdist_group("server-pool")
def test_one_server_per_configuration_serves_every_run_of_it(pooled: dict[str, Any]) -> None:
    """tp2 and tp4 at seeds 0 and 1 of a synthetic model (a seed reseeds its weights: another model): tp1, tp2
    and tp4 per seed, 6 servers for 4 cells, 2 references and 2 noise twins (8 runs); each stopped. The report's
    provenance counts them."""
    assert pooled["exit"] == 0 and {c["status"] for c in pooled["cells"]} == {"PASS"}
    servers = pooled["servers"]
    assert len(servers) == 6 and all(s["origin"] == "started" and s["stopped"] for s in servers)
    assert sorted(len(s["runs"]) for s in servers) == [1, 1, 1, 1, 2, 2]  # tp1's: the reference and its twin
    assert not any(pid_alive(s["pid"]) for s in servers)
    assert "6 started, 0 kept from an earlier run, for 8 runs" in (pooled["out"] / "index.html").read_text()
    by_id = {s["id"]: s for s in servers}
    for cell in pooled["cells"]:  # each run names the server that served it, and that server lists the run
        for run_dir in (cell["run_dir"], cell["reference_dir"]):
            record = _served(run_dir)
            assert Path(run_dir).resolve() in {Path(r).resolve() for r in by_id[record["id"]]["runs"]}
            assert record["argv_sha256"] == by_id[record["id"]]["argv_sha256"]
            assert (Path(run_dir) / "server.log").read_text().count("harness-serve KV cache") == 1
    # the reference and its scheduling-noise twin: one server, the twin's lease reused it
    ref = pooled["cells"][0]["reference_dir"]
    reference, twin = by_id[_served(ref)["id"]]["runs"]
    assert Path(reference).resolve() == Path(ref).resolve() and "-r-" in Path(twin).name
    assert _served(reference)["started"] is True and _served(twin)["started"] is False


@pytest.mark.slow
@pytest.mark.xdist_group("server-pool")
def test_verdicts_equal_those_of_a_server_per_run(pooled: dict[str, Any], tmp_path: Path) -> None:
    """Server reuse never changes a verdict: the same matrix with a fresh server for every run (its own cache,
    so its references are launched too) gives every check the same verdict."""
    fresh = _run(tmp_path / "out", tmp_path / "cache", "--seed", "0", "--seed", "1", "--server-per-run")
    assert fresh["servers"] == [] and _verdicts(fresh) == _verdicts(pooled)
    assert all(_served(c["run_dir"])["started"] for c in fresh["cells"])


@pytest.mark.slow
@pytest.mark.xdist_group("server-pool")
def test_kept_servers_are_reused_by_the_next_run_and_stopped_by_a_run_without_the_flag(
        pooled: dict[str, Any], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    state = cache / "servers" / STATE_FILE
    try:
        first = _run(tmp_path / "a", cache, "--seed", "0", "--keep-servers")
        assert len(first["servers"]) == 3 and not any(s["stopped"] for s in first["servers"])
        assert all(pid_alive(s["pid"]) for s in first["servers"]) and len(read_json(state)) == 3
        # the references are cached now: the next run needs tp2 and tp4 only, and starts neither
        second = _run(tmp_path / "b", cache, "--seed", "0", "--keep-servers")
        assert [s["origin"] for s in second["servers"]] == ["kept", "kept"]
        assert all(not _served(c["run_dir"])["started"] for c in second["cells"])
        assert _verdicts(second) == _verdicts(first) == {k: v for k, v in _verdicts(pooled).items() if k[1] == 0}
        third = _run(tmp_path / "c", cache, "--seed", "0")  # reuses them, then stops them
        assert [s["origin"] for s in third["servers"]] == ["kept", "kept"]
        assert all(s["stopped"] and not pid_alive(s["pid"]) for s in third["servers"])
        left = read_json(state)  # the tp1 server, which the third run did not use, is still listed and up
        assert len(left) == 1 and pid_alive(left[0]["pid"])
        assert main(["cache", "--cache-dir", str(cache), "servers", "--stop"]) == 0
        assert not state.exists() and not pid_alive(left[0]["pid"])
    finally:
        stop_kept(state)


def _kill_first_tp2_server(servers: Path, done: threading.Event) -> None:
    """SIGKILL the first plain tp2 server to appear under `servers` (as soon as its pid file is written)."""
    while not done.is_set():
        for folder in sorted(servers.glob("*")) if servers.is_dir() else []:
            argv = folder / "server.argv.json"
            if (folder / PID_FILE).is_file() and argv.is_file() and '"tp2"' in argv.read_text() \
                    and "--spec-k" not in argv.read_text():
                os.kill(int((folder / PID_FILE).read_text()), signal.SIGKILL)
                return
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.xdist_group("server-pool")
def test_a_server_that_dies_under_a_cell_is_an_error_and_the_next_run_gets_a_fresh_one(tmp_path: Path) -> None:
    """tp2 and tp2-draft of the spec suite share the plain tp2 server. Killed under the tp2 cell, that cell is
    an ERROR with the server's log; tp2-draft's plain run starts a fresh tp2 server and PASSes."""
    out = tmp_path / "out"
    done = threading.Event()
    killer = threading.Thread(target=_kill_first_tp2_server, args=(out / "servers", done), daemon=True)
    killer.start()
    try:
        code = main(["run", "--suite", "spec", "--engine", "harness-serve", "--topo", "tp2,tp2-draft",
                     "--workload", "prompts", "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    finally:
        done.set()
    cells = {c["topology"]: c for c in results_cells(out)}
    assert code == 3 and cells["tp2"]["status"] == "ERROR", cells["tp2"]["checks"]
    assert "server exited with code -9 before it was ready" in cells["tp2"]["checks"][0]["reason"]
    assert cells["tp2-draft"]["status"] == "PASS", cells["tp2-draft"]["checks"]
    servers = read_json(out / "results.json")["provenance"]["servers"]
    tp2 = [s for s in servers if "tp2" in s["argv"]]  # harness serve --topo tp2: the plain tp2 server
    assert [s["stopped"] for s in tp2] == ["a run it served failed", "the run ended"]
    assert [Path(r).resolve() for r in tp2[0]["runs"]] == [Path(cells["tp2"]["run_dir"]).resolve()]
    assert _served(cells["tp2-draft"]["run_dir"])["id"] == tp2[1]["id"]
