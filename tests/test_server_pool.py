"""One engine server per engine configuration for a whole `harness run` (harness/backends/http/pool.py), over
the harness's own HTTP server (`--engine harness-serve`, real servers on loopback): the reference, its noise
twin and every cell of one configuration share a server; the verdicts equal those of a server per run; kept
servers (--keep-servers) are reused by the next run and stopped by a run without the flag; a server that dies
under a cell makes that cell an ERROR with its log, and the next run of its configuration gets a fresh one."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness.backends.http.backend import HttpBackend, server_seed
from harness.backends.http.capture import CASES_FILE, write_probe_cases
from harness.backends.http.pool import PID_FILE, STATE_FILE, ServerConfig, ServerPool, pid_alive, stop_kept
from harness.backends.http.server import free_port, running_server, wait_ready
from harness.cli import build_parser, main
from harness.cli.run import build_request
from harness.core.jsonio import read_json
from harness.flow.runner import CellPlan, Runner, serving_order
from harness.formats.locate import load_model
from harness.records.results import results_cells
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
    """By model, weights (where the engines reseed a synthetic model's weights by the run seed; a checkpoint's
    stay), tp/dcp (a -draft cell beside its plain one, whose server it shares), then seed."""
    synthetic = load_model("tiny-gqa")
    checkpoint = replace(synthetic, name="ckpt", source="hf", path="/ckpt")
    cells = [CellPlan(m, parse_topology_name(t), None, seed, None)
             for m in (synthetic, checkpoint) for seed in (0, 1) for t in ("tp2", "tp4", "tp2-draft")]
    assert [cells[i].slug for i in serving_order(cells)] == [
        "tiny-gqa/tp2/seed0", "tiny-gqa/tp2-draft/seed0", "tiny-gqa/tp4/seed0",
        "tiny-gqa/tp2/seed1", "tiny-gqa/tp2-draft/seed1", "tiny-gqa/tp4/seed1",
        "ckpt/tp2/seed0", "ckpt/tp2-draft/seed0", "ckpt/tp2/seed1", "ckpt/tp2-draft/seed1",
        "ckpt/tp4/seed0", "ckpt/tp4/seed1"]
    # a server engine keeps the model's own weights for every seed: a synthetic model's seeds share its servers
    assert [cells[i].slug for i in serving_order(cells, reseeds=False)][:6] == [
        "tiny-gqa/tp2/seed0", "tiny-gqa/tp2-draft/seed0", "tiny-gqa/tp2/seed1", "tiny-gqa/tp2-draft/seed1",
        "tiny-gqa/tp4/seed0", "tiny-gqa/tp4/seed1"]


def _runner(tmp_path: Path, engine: str) -> Runner:
    args = build_parser().parse_args([*TP[:TP.index("--engine")], "--engine", engine, "--model", "tiny-hd64",
                                      "--seed", "0", "--seed", "1", "--out", str(tmp_path / "out"),
                                      "--cache-dir", str(tmp_path / "cache")])
    return Runner(build_request(args), progress=lambda _: None)


def test_a_server_engine_serves_every_seed_of_a_run_on_one_configuration(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's template (its probe captures hidden states): seeds 0 and 1 run the model's own weights (the run seed
    seeds the cases and each request), so their jobs share one engine configuration; the probe is told both seeds'
    cases, each under ids of its own. The embedded engine still reseeds a synthetic model's weights per seed."""
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)
    runner = _runner(tmp_path, "vllm")
    backend = runner.backend
    assert isinstance(backend, HttpBackend) and not runner.reseeds
    topo = parse_topology_name("tp2")
    jobs = [runner.job(runner.req.models[0], topo, None, seed, tmp_path / f"run{seed}") for seed in (0, 1)]
    assert jobs[0].model == jobs[1].model and jobs[0].seed != jobs[1].seed
    argv = backend.command(jobs[1], "{model}", 0)[0]
    # the server's seed is the topology's own ({server_seed}), not the run seed
    assert argv[argv.index("--seed") + 1] == str(server_seed("tp2")) == backend.command(jobs[0], "{model}", 0)[0][
        argv.index("--seed") + 1]
    with runner.servers.session():
        probed = [backend._probe_cases(job) for job in jobs]
        keys = {backend._server_config(job, cases).key for job, (cases, _) in zip(jobs, probed)}
        assert len(keys) == 1
        sets, offsets = probed[0][0], [offset for _, offset in probed]
        assert len(sets) == 2 and sets[0] != sets[1] and offsets[0] == 0 < offsets[1]
        write_probe_cases(tmp_path / "probe", sets)
        listed = {e["case"]: tuple(e["sequence_ids"]) for e in read_json(tmp_path / "probe" / CASES_FILE)}
        assert len(listed) == len(sets[0]) + len(sets[1])  # no two cases share a capture id
        for cases, offset in zip(sets, offsets):
            assert all(listed[offset + case.index] == tuple(case.sequence_ids) for case in cases)
    assert Runner.job(_runner(tmp_path / "e", "embedded"), runner.req.models[0], topo, None, 1, tmp_path).model \
        != jobs[1].model


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pooled")
    return _run(root / "out", root / "cache", "--seed", "0", "--seed", "1")


@pytest.mark.slow
@pytest.mark.xdist_group("server-pool")
def test_one_server_per_configuration_serves_every_run_of_it(pooled: dict[str, Any]) -> None:
    """tp2 and tp4 at seeds 0 and 1 of a synthetic model (a server engine keeps the model's weights for every
    seed): tp1, tp2 and tp4, 3 servers for 4 cells, 2 references and 2 noise twins (8 runs); each stopped. The
    report's provenance counts them."""
    assert pooled["exit"] == 0 and {c["status"] for c in pooled["cells"]} == {"PASS"}
    servers = pooled["servers"]
    assert len(servers) == 3 and all(s["origin"] == "started" and s["stopped"] for s in servers)
    assert sorted(len(s["runs"]) for s in servers) == [2, 2, 4]  # tp1's: each seed's reference and its twin
    assert not any(pid_alive(s["pid"]) for s in servers)
    assert "3 started, 0 kept from an earlier run, for 8 runs" in (pooled["out"] / "index.html").read_text()
    by_id = {s["id"]: s for s in servers}
    for cell in pooled["cells"]:  # each run names the server that served it, and that server lists the run
        for run_dir in (cell["run_dir"], cell["reference_dir"]):
            record = _served(run_dir)
            assert Path(run_dir).resolve() in {Path(r).resolve() for r in by_id[record["id"]]["runs"]}
            assert record["argv_sha256"] == by_id[record["id"]]["argv_sha256"]
            assert (Path(run_dir) / "server.log").read_text().count("harness-serve KV cache") == 1
    # each seed's reference and its scheduling-noise twin: one server, every lease after the first reused it
    ref = pooled["cells"][0]["reference_dir"]
    runs = by_id[_served(ref)["id"]]["runs"]
    assert Path(runs[0]).resolve() == Path(ref).resolve() and ["-r-" in Path(r).name for r in runs] == [
        False, True, False, True]
    assert [_served(r)["started"] for r in runs] == [True, False, False, False]
    assert {read_json(Path(r) / "manifest.json")["seed"] for r in runs} == {0, 1}


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


@pytest.mark.slow
@pytest.mark.xdist_group("server-pool")
def test_an_attached_server_serves_every_run_of_its_topology_and_is_left_running(pooled: dict[str, Any],
                                                                                 tmp_path: Path) -> None:
    """--attach tp2=URL: a `harness serve` the user runs serves both seeds' tp2 cells; the harness starts tp1 and
    tp4 only, never stops the attached one, and the report names which server served which run. The attached
    runs have no server log or probe here: the checks that read them say so; every other verdict is the pooled
    run's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "harness", "serve", "--model", "tiny-gqa", "--topo", "tp2", "--port", str(port),
            "--max-seq-len", "128", "--kv-budget-mib", "8", "--max-logprobs", "20"]
    with running_server(argv, {}, tmp_path / "mine.log", url) as mine:
        wait_ready(mine, "/health", 300)
        run = _run(tmp_path / "out", tmp_path / "cache", "--seed", "0", "--seed", "1", "--attach", f"tp2={url}")
        assert mine.proc is not None and mine.proc.poll() is None  # still up: the harness never stops it
    expected = _verdicts(pooled)
    for (topo, _, _), checks in expected.items():
        if topo == "tp2":  # no server log (its KV capacity) and no probe report of an attached server
            checks["layout"] = "SKIP"
    assert _verdicts(run) == expected
    layout = next(k for k in run["cells"][0]["checks"] if k["name"] == "layout")
    assert run["cells"][0]["topology"] == "tp2" and "gives none of layout_report, kv_pool_size" in layout["reason"]
    servers = {s["id"]: s for s in run["servers"]}
    assert sorted(s["origin"] for s in servers.values()) == ["attached", "started", "started"]
    attached = servers["attached-1"]
    assert attached["url"] == url and attached["topology"] == "tp2" and attached["pid"] is None
    tp2 = [c for c in run["cells"] if c["topology"] == "tp2"]
    assert {Path(r).resolve() for r in attached["runs"]} == {Path(c["run_dir"]).resolve() for c in tp2}
    assert all(_served(c["run_dir"])["origin"] == "attached" and _served(c["run_dir"])["url"] == url for c in tp2)
    html = (run["out"] / "index.html").read_text()
    assert "2 started, 0 kept from an earlier run, 1 attached, for 8 runs" in html
    assert "server attached-1" in html and "tiny-gqa/tp2/seed0, tiny-gqa/tp2/seed1" in html


@pytest.mark.parametrize(("engine", "attach", "message"), [
    ("harness-serve", "tp8=http://127.0.0.1:1", "this run serves no topology 'tp8'; it serves tp1, tp2, tp4"),
    ("harness-serve", "tp2", "'tp2' is not TOPO=URL"),
    ("harness-serve", "tp2=127.0.0.1:1", "the URL must be http(s)://HOST[:PORT], got '127.0.0.1:1'"),
    ("embedded", "tp2=http://127.0.0.1:1", "engine embedded starts no HTTP server to attach in its place"),
])
def test_a_bad_attach_is_one_usage_error(engine: str, attach: str, message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = [*TP[:TP.index("--engine")], "--engine", engine, "--topo", "tp2,tp4", "--attach", attach]
    assert main([*args, "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("harness: error:") == 1, err


# A server that answers its health path and, on SIGTERM, writes when it was asked to stop, takes a second to shut
# down (as vLLM's engine core and workers do) and writes when it exits.
SLOW_STOP = """
import http.server, signal, sys, threading, time
port, marks = int(sys.argv[1]), sys.argv[2]
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
def stop(signum, frame):
    with open(marks, "a") as f:
        f.write(f"term {time.time()}\\n")
    time.sleep(1.0)
    with open(marks, "a") as f:
        f.write(f"exit {time.time()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    time.sleep(0.1)
"""


def test_a_run_stops_its_servers_side_by_side(tmp_path: Path) -> None:
    """Three servers up when the session ends: each is asked to stop before any has exited (their shutdowns
    overlap instead of adding up), and every one is stopped and recorded as such."""
    pool = ServerPool(folder=tmp_path / "servers")
    marks = [tmp_path / f"marks-{k}" for k in range(3)]
    with pool.session():
        for k, mark in enumerate(marks):
            config = ServerConfig(key=f"{k:064x}", need=str(k), health="/health", topology=f"tp{k + 1}")
            def launch(log: Path, port: int, mark: Path = mark) -> tuple[list[str], dict[str, str | None]]:
                return [sys.executable, "-c", SLOW_STOP, str(port), str(mark)], {}

            with pool.lease(config, tmp_path / f"run-{k}" / "server.log", launch, timeout_s=60):
                pass
    times = {kind: [float(line.split()[1]) for m in marks for line in m.read_text().splitlines()
                    if line.startswith(kind)] for kind in ("term", "exit")}
    assert len(times["term"]) == len(times["exit"]) == 3
    assert max(times["term"]) < min(times["exit"])
    assert [s["stopped"] for s in pool.records()] == ["the run ended"] * 3
    assert not any(pid_alive(s["pid"]) for s in pool.records())
