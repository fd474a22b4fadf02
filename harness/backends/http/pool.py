"""Engine servers shared by the runs of one `harness run`: one server per distinct engine configuration.

A configuration is what decides a server's answers: its argv and environment with the port left out (the model,
its weights, topology, dtype, engine arguments), the engine's own environment variables and, for a server whose
probe captures hidden states, the cases it captures (those of every seed of the session: `seeds`, so one server
serves every seed). Every run that needs a configuration (each seed's requests,
workload, noise twin and reference) leases its server: the first lease starts it, later ones reuse it. The
runner orders its cells so the runs of one configuration are adjacent and, before each cell, lets the pool stop
the servers no later run needs (`retain`), so at most a few are up at once.

A lease that ends in an error stops its server (a server that crashed, hung or answered wrongly is never trusted
again); the next run of its configuration starts a fresh one, and a server found dead when leased is replaced.
After each lease the server's log (and its probe's folder) is copied into the run's folder, so a run folder
holds the log of the server that served it, as when it had a server of its own.

A configuration can be served by a server the user runs (`attach`: topology name -> URL, `harness run --attach
TOPO=URL`): every run of that topology is sent there; it is never started or stopped, and has no log or probe
folder here, so its runs provide what the HTTP API gives (the layout probe, captures and the logged KV capacity
are left out of their capabilities: harness/backends/http/backend.py).

Outside a session (`ServerPool.session`) each lease starts a server in the run's own folder and stops it
afterwards: one server per run. With `keep` the servers outlive the run: they are listed in a state file
(`CACHE/servers/servers.json`: configuration, pid, URL, folder) and a later run adopts the live ones of its
configurations ("kept"); a run without `keep` stops the servers it used when it ends.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.backends.http.server import Server, ServerEnv, launch_ready, pid_alive, stop_server
from harness.core.jsonio import write_text_atomic
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

STATE_FILE = "servers.json"
SERVER_LOG = "server.log"
PID_FILE = "server.pid"  # the server leader's pid, beside its log
ADOPT_HEALTH_TIMEOUT_S = 5.0
ATTACHED = "attached"  # a server's origin when the user runs it (--attach TOPO=URL)

HOST = "127.0.0.1"  # where the pool's servers listen

# a lease's launch callable: (server log, port) -> the server's argv and its extra environment; called once
# per launch (a port taken before the server bound it is picked again: http_server.launch_ready)
Launch = Callable[[Path, int], tuple[list[str], ServerEnv]]


def digest(value: Any) -> str:
    """sha256 of `value` as sorted JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def server_need(model: ModelSpec, dtype: str, topology: Topology) -> str:
    """What the runner and a backend both know of a run's server before it starts: the model (seeded weights
    included), dtype and the topology's tp and dcp. Coarser than a configuration (the speculator and faults
    are left out), so a server is kept while any later run may need it."""
    return digest({"model": model.to_dict(), "dtype": dtype, "tp": topology.tp, "dcp": topology.dcp})


@dataclass(frozen=True)
class ServerConfig:
    """One engine configuration: `key` identifies it (digest of what decides the server's answers), `need` is
    its server_need, `health` the path that answers 200 when it is ready, `topology` the name of the topology it
    serves (what `--attach TOPO=URL` names)."""

    key: str
    need: str
    health: str
    topology: str = ""


@dataclass
class PooledServer:
    """A server of the pool and what it served."""

    id: str            # unique per start: the configuration's first 12 hex digits and a start count
    config: ServerConfig
    server: Server
    folder: Path | None  # None: a server someone else runs (attached)
    argv: list[str]
    origin: str        # "started" by this run, "kept" (started by an earlier run with --keep-servers) or "attached"
    runs: list[str] = field(default_factory=list)  # the run folders it served
    stopped: str | None = None  # why it was stopped, once stopped

    def record(self) -> dict[str, Any]:
        pid = self.server.proc.pid if self.server.proc is not None else None
        return {"id": self.id, "config": self.config.key[:12], "argv_sha256": digest(self.argv), "argv": self.argv,
                "pid": pid, "topology": self.config.topology,
                "url": self.server.base_url, "log": str(self.server.log_path) if self.folder is not None else None,
                "origin": self.origin, "runs": list(self.runs), "stopped": self.stopped}


class AdoptedProcess:
    """A kept server's leader, started by an earlier process (not this one's child), seen through Popen's
    interface (pid, poll, wait) so stop_server stops it and its group as it stops any server."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None if pid_alive(self.pid) else 0

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while pid_alive(self.pid):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0.0)
            time.sleep(0.1)
        return 0


@dataclass
class Lease:
    """A run's use of a server: the server, and the record the run's manifest keeps (which server, its argv
    hash, whether this lease started it)."""

    server: Server
    record: dict[str, Any]
    ready_s: float  # seconds this lease waited for the server to start (0 for a server already up)


class ServerPool:
    """The servers of one `harness run` (`folder` set: a session, servers live in folder/<id>/), or none
    (`folder` None: each lease starts and stops a server of its own in the run's folder)."""

    def __init__(self, folder: Path | None = None, keep: bool = False, state_file: Path | None = None,
                 seeds: Sequence[int] = (), attach: Mapping[str, str] | None = None) -> None:
        self.folder = folder
        self.keep = keep
        self.state_file = state_file
        # topology name -> the URL of a server someone else runs, which serves every run of that topology
        self.attach = dict(attach or {})
        self._attached: dict[str, PooledServer] = {}  # URL -> its entry
        # the run seeds whose requests one server may serve: a server's probe is told every one's cases at start
        self.seeds = tuple(sorted(set(seeds)))
        self._up: dict[str, PooledServer] = {}        # configuration key -> its running server
        self._kept: dict[str, dict[str, Any]] = {}    # configuration key -> a kept server's state entry
        self.served: list[PooledServer] = []           # every server this run used, in order of first use
        self.leases: list[str] = []                    # the run folder of every lease, in order
        self.started = 0                               # servers started (a server per run: one per lease)

    # -- the session ---------------------------------------------------------------------------------------

    @contextmanager
    def session(self) -> Iterator[ServerPool]:
        """Make this pool the one leases use (`current()`) until the block ends; then stop its servers, or keep
        them (state file) with `keep`."""
        self._adopt()
        _SESSIONS.append(self)
        try:
            yield self
        finally:
            _SESSIONS.remove(self)
            self.close()

    def close(self) -> None:
        if self.keep:
            self._write_state()
            return
        self._stop_all(list(self._up.values()), "the run ended")
        self._write_state()

    # -- leases --------------------------------------------------------------------------------------------

    @contextmanager
    def lease(self, config: ServerConfig, log_path: Path, launch: Launch, timeout_s: float) -> Iterator[Lease]:
        """The server of `config` for one run whose server log belongs at `log_path`. `launch(log, port)` writes
        what the server needs beside `log` (its probe's folder) and gives its argv and environment; a server
        started for the lease must be ready within `timeout_s`. A lease that ends in an exception stops the
        server."""
        self.leases.append(run_folder(log_path.parent))
        if config.topology in self.attach:
            yield from self._attach(config, self.attach[config.topology], log_path)
            return
        if self.folder is None:
            yield from self._own(config, log_path, launch, timeout_s)
            return
        entry = self._up.get(config.key)
        if entry is not None and entry.server.exited() is not None:  # died since its last run: replace it
            self._stop(entry, f"exited with code {entry.server.exited()} between runs")
            entry = None
        started = entry is None
        t0 = time.monotonic()
        if entry is None:
            entry = self._adopted(config) or self._start(config, launch, timeout_s, log_path)
        else:
            shutil.rmtree(probe_folder(entry.server.log_path) / "capture", ignore_errors=True)  # this run's only
        ready_s = time.monotonic() - t0 if started else 0.0
        if entry not in self.served:
            self.served.append(entry)
        entry.runs.append(run_folder(log_path.parent))
        record = {"id": entry.id, "config": config.key[:12], "argv_sha256": digest(entry.argv),
                  "started": started and entry.origin == "started", "origin": entry.origin}
        ok = False
        try:
            yield Lease(entry.server, record, ready_s)
            ok = True
        finally:
            _copy_out(entry.server.log_path, log_path)
            if not ok:
                self._stop(entry, "a run it served failed")

    def _attach(self, config: ServerConfig, url: str, log_path: Path) -> Iterator[Lease]:
        """The server at `url` (someone else runs it: never started or stopped here, its log is not ours) for one
        run; the lease waits for its health path as for any server."""
        entry = self._attached.get(url)
        if entry is None:
            entry = PooledServer(id=f"attached-{len(self._attached) + 1}", config=config,
                                 server=Server(base_url=url, log_path=log_path), folder=None, argv=[],
                                 origin=ATTACHED)
            self._attached[url] = entry
            self.served.append(entry)
        entry.runs.append(run_folder(log_path.parent))
        yield Lease(Server(base_url=url, log_path=log_path), {"id": entry.id, "config": config.key[:12],
                                                               "argv_sha256": None, "started": False,
                                                               "origin": ATTACHED, "url": url}, 0.0)

    def _own(self, config: ServerConfig, log_path: Path, launch: Launch, timeout_s: float) -> Iterator[Lease]:
        """One server for one run, in the run's folder, stopped when the run ends."""
        server, ready_s, argv = self._launch(config, log_path, launch, timeout_s, warm=True)
        assert server.proc is not None
        try:
            yield Lease(server, {"id": None, "config": config.key[:12], "argv_sha256": digest(argv), "started": True,
                                 "origin": "started"}, ready_s)
        finally:
            stop_server(server.proc)

    def _launch(self, config: ServerConfig, log_path: Path, launch: Launch, timeout_s: float, warm: bool,
                on_start: Callable[[Server, list[str]], None] | None = None) -> tuple[Server, float, list[str]]:
        """A server of `config` started and ready, its argv kept beside its log from its launch on: (server,
        seconds to ready, argv)."""
        def launched(server: Server, argv: list[str]) -> None:
            log_path.with_suffix(".argv.json").write_text(json.dumps(argv, indent=1) + "\n")
            self.started += 1
            if on_start is not None:
                on_start(server, argv)

        return launch_ready(lambda port: launch(log_path, port), log_path, HOST, config.health, timeout_s, warm,
                            launched)

    def _start(self, config: ServerConfig, launch: Launch, timeout_s: float, run_log: Path) -> PooledServer:
        """A new server of `config` in a folder of its own, listed among the servers this run used from its
        launch on (a start that fails is recorded as stopped by the run `run_log` belongs to, with its log)."""
        assert self.folder is not None
        n = sum(1 for s in self.served if s.config.key == config.key) + 1
        while True:  # a folder of its own (another process keeping servers in the same cache may have one)
            folder = self.folder / f"{config.key[:12]}-{n}"
            try:
                folder.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
        log_path = folder / SERVER_LOG
        entry: PooledServer | None = None

        def launched(server: Server, argv: list[str]) -> None:  # listed, and findable by its pid, from the start
            nonlocal entry
            assert server.proc is not None
            (folder / PID_FILE).write_text(f"{server.proc.pid}\n")
            if entry is None:
                entry = PooledServer(id=folder.name, config=config, server=server, folder=folder, argv=argv,
                                     origin="started")
                self.served.append(entry)
            else:  # launched again on another port
                entry.server, entry.argv = server, argv

        try:
            self._launch(config, log_path, launch, timeout_s, not self.keep, launched)  # kept: outlives this process
        except BaseException:
            if entry is not None:
                entry.runs.append(run_folder(run_log.parent))
                entry.stopped = "a run it served failed"
                _copy_out(log_path, run_log)
            raise
        assert entry is not None
        self._up[config.key] = entry
        return entry

    def _stop(self, entry: PooledServer, why: str) -> None:
        self._stop_all([entry], why)

    def _stop_all(self, entries: Sequence[PooledServer], why: str) -> None:
        """Stop `entries`' servers side by side: each stop waits up to the server's grace for its processes to
        exit (vLLM's engine core and workers take 10-20 s on 2 cores), so one after another a run's servers
        took the sum of those waits."""
        procs = [e.server.proc for e in entries if e.server.proc is not None]
        if procs:
            with ThreadPoolExecutor(max_workers=len(procs), thread_name_prefix="server-stop") as stopping:
                list(stopping.map(stop_server, procs))  # every stop ends before the first error is raised
        for entry in entries:
            entry.stopped = why
            if self._up.get(entry.config.key) is entry:
                del self._up[entry.config.key]

    def retain(self, needs: set[str]) -> None:
        """Stop the servers whose need (server_need) is not in `needs`: no later run needs them (kept with
        `keep`)."""
        if self.keep:
            return
        self._stop_all([e for e in self._up.values() if e.config.need not in needs], "no later run needed it")

    def records(self) -> list[dict[str, Any]]:
        """Each server this run used: its id, configuration, argv and its hash, URL, log, whether this run
        started it, the runs it served, and why it stopped (None: still up, kept)."""
        return [s.record() for s in self.served]

    # -- kept servers ---------------------------------------------------------------------------------------

    def _adopted(self, config: ServerConfig) -> PooledServer | None:
        """The kept server of `config` from the state file, when it still runs and answers its health path."""
        state = self._kept.pop(config.key, None)
        if state is None or not pid_alive(int(state["pid"])):
            return None
        try:
            healthy = httpx.get(state["url"] + config.health, timeout=ADOPT_HEALTH_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if not healthy:
            return None
        folder = Path(state["folder"])
        server = Server(base_url=state["url"], log_path=folder / SERVER_LOG, proc=AdoptedProcess(int(state["pid"])))
        entry = PooledServer(id=state["id"], config=config, server=server, folder=folder, argv=list(state["argv"]),
                             origin="kept")
        self._up[config.key] = entry
        return entry

    def _adopt(self) -> None:
        """Read the kept servers of the state file (the live ones)."""
        if self.state_file is None:
            return
        with _locked(self.state_file):
            entries = _read_state(self.state_file)
        self._kept = {e["config_key"]: e for e in entries if pid_alive(int(e["pid"]))}

    def _write_state(self) -> None:
        """The state file: the servers kept up (this run's with `keep`), and those of earlier runs this run
        did not touch."""
        if self.state_file is None:
            return
        mine = {s.config.key for s in self.served}
        with _locked(self.state_file):
            entries = [e for e in _read_state(self.state_file)
                       if e["config_key"] not in mine and pid_alive(int(e["pid"]))]
            entries += [{"config_key": s.config.key, "id": s.id, "pid": s.server.proc.pid, "url": s.server.base_url,
                         "folder": str(s.folder), "argv": s.argv}
                        for s in self._up.values() if s.server.proc is not None]
            if entries:
                write_text_atomic(self.state_file, json.dumps(entries, indent=1) + "\n")
            else:
                self.state_file.unlink(missing_ok=True)


_SESSIONS: list[ServerPool] = []


def current() -> ServerPool:
    """The pool of the session in progress, else a pool without one (a server per run)."""
    return _SESSIONS[-1] if _SESSIONS else ServerPool()


def run_folder(folder: Path) -> str:
    """A run's folder as the run keeps it: a reference launched into the cache's staging folder
    (NAME.PID.partial, harness/flow/refcache.py) by NAME, the folder it is renamed to."""
    suffix = f".{os.getpid()}.partial"
    return str(folder.with_name(folder.name[:-len(suffix)]) if folder.name.endswith(suffix) else folder)


def probe_folder(log_path: Path) -> Path:
    """The folder a server's layout probe writes to: beside its log (server.log -> server.layout/)."""
    return log_path.with_suffix(".layout")


def _copy_out(server_log: Path, run_log: Path) -> None:
    """The server's log, argv and probe folder into the run's folder (under the run's log name)."""
    if server_log == run_log:
        return
    run_log.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(probe_folder(run_log), ignore_errors=True)
    for src, dst in ((server_log, run_log), (server_log.with_suffix(".argv.json"), run_log.with_suffix(".argv.json"))):
        try:
            shutil.copyfile(src, dst)
        except OSError:
            pass
    if probe_folder(server_log).is_dir():
        shutil.copytree(probe_folder(server_log), probe_folder(run_log), dirs_exist_ok=True)


def _read_state(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


@contextmanager
def _locked(state_file: Path) -> Iterator[None]:
    state_file.parent.mkdir(parents=True, exist_ok=True)
    with open(state_file.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def kept(state_file: Path) -> list[dict[str, Any]]:
    """The kept servers the state file lists (id, pid, url, folder, argv, config_key)."""
    with _locked(state_file):
        return _read_state(state_file)


def stop_kept(state_file: Path) -> list[str]:
    """Stop every server the state file lists (SIGTERM to its group, as stop_server); their ids."""
    with _locked(state_file):
        entries = _read_state(state_file)
        state_file.unlink(missing_ok=True)
    stopped = []
    for e in entries:
        if pid_alive(int(e["pid"])):
            stop_server(AdoptedProcess(int(e["pid"])))  # type: ignore[arg-type]
            stopped.append(str(e["id"]))
    return stopped


__all__ = ["AdoptedProcess", "Lease", "PooledServer", "ServerConfig", "ServerPool", "current", "digest", "kept",
           "server_need", "stop_kept"]
