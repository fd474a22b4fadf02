"""Warm CPU launches: the launcher process of a single-node CPU run is forked from a multiprocessing
forkserver that imported torch and the engine once per harness process, instead of being a fresh
interpreter that imports them again (~3 CPU-seconds per launch on a 2-core box, most of a small run).
An engine server whose command is this interpreter's `-m harness ...` (the harness-serve engines) is
forked from it the same way.

The forked launcher behaves like `python -m harness.launcher.forkrun` (or, at world size 1, the worker
itself) started by Popen with start_new_session=True: its own session and process group, the
launch's environment and working directory, stdout/stderr into the launch's log, the exit code of
the run (-N when killed by signal N). `WarmProcess` offers the part of Popen that launch() uses.

What the forkserver fixed at its start cannot change per launch: OpenMP reads OMP_WAIT_POLICY when
torch loads it. So the forkserver is started with the first warm launch's policy, and a launch that
asks for another one is not warm (launch() falls back to a fresh interpreter). Thread counts are set
per launch (torch.set_num_threads from OMP_NUM_THREADS).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

# Modules named, never imported here: the launcher and the CLI sit above this module.
FORKRUN_MODULE = "harness.launcher.forkrun"
CLI_MODULE = "harness.cli"
# and the first launch's worker module: what every launch would import again (numpy.random: imported on first use,
# by the synthetic weights and the cases' generators, which every rank builds)
PRELOAD = ["torch", "numpy.random", FORKRUN_MODULE]
WAIT_POLICY_VAR = "OMP_WAIT_POLICY"  # read by OpenMP once, when torch is imported
_lock = threading.Lock()
_policy: list[str | None] = []  # the wait policy the forkserver started with (empty: not started)


class WarmProcess:
    """A forked launcher, seen through Popen's interface (pid, returncode, wait, poll)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout or 0.0)
        return int(self._process.exitcode)


def usable(env: Mapping[str, str]) -> bool:
    """Whether a launch with `env` can be forked warm: this process's __main__ can be prepared in a forked
    child, and the forkserver is not running yet (it will start with this policy) or runs with the same
    OMP_WAIT_POLICY."""
    with _lock:
        return main_preparable() and (not _policy or _policy[0] == env.get(WAIT_POLICY_VAR))


def main_preparable() -> bool:
    """Whether a child of the forkserver can prepare this process's __main__ as multiprocessing does before
    its target runs: by module name (`python -m`), or by running the main file again (a script), or not at
    all (no file: `python -c`, an embedding). A script read from standard input names its file '<stdin>',
    which is nowhere: every warm launch would fail before its first line, so such a caller launches fresh."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return True
    path = getattr(main, "__file__", None)
    if path is None:
        return True
    return (Path(multiprocessing.process.ORIGINAL_DIR or os.getcwd()) / path).is_file()


def start(world: int, log_path: Path, log_dir: Path | None, module: str, worker_args: Sequence[str],
          env: Mapping[str, str]) -> WarmProcess:
    """Fork the launcher of a `world`-rank run of `module` with `worker_args` (the job file, worker flags)."""
    return _fork(("launch", world, str(log_dir) if log_dir else None, module, list(worker_args)), log_path, env,
                 module)


def harness_command(argv: Sequence[str]) -> list[str] | None:
    """The harness CLI arguments of `argv` when it runs this interpreter's `-m harness` (an engine
    server template's `{python} -m harness serve ...`), else None."""
    if len(argv) >= 3 and list(argv[:3]) == [sys.executable, "-m", "harness"]:
        return list(argv[3:])
    return None


def start_command(args: Sequence[str], log_path: Path, env: Mapping[str, str]) -> WarmProcess:
    """Fork `harness ARGS` (e.g. a `harness serve` engine server) as if started by Popen."""
    return _fork(("cli", list(args)), log_path, env, CLI_MODULE)


def _fork(what: tuple[Any, ...], log_path: Path, env: Mapping[str, str], preload: str) -> WarmProcess:
    context = multiprocessing.get_context("forkserver")
    with _lock:
        _ensure_server(context, _policy[0] if _policy else env.get(WAIT_POLICY_VAR), preload)
        # daemon: should a launch outlive its caller's normal exit, multiprocessing terminates it then
        process = context.Process(target=_child, name="harness-launch", daemon=True,
                                  args=(what, str(log_path), dict(env), os.getcwd()))
        process.start()
    return WarmProcess(process)


def _ensure_server(context: Any, policy: str | None, preload: str) -> None:
    """Start the forkserver (again, if it died) with `policy` in its environment (it inherits this
    process's environment when it starts), preloading PRELOAD and `preload`."""
    context.set_forkserver_preload([*PRELOAD, preload])
    previous = os.environ.get(WAIT_POLICY_VAR)
    _set(WAIT_POLICY_VAR, policy)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        _set(WAIT_POLICY_VAR, previous)
    if not _policy:
        _policy.append(policy)
        atexit.register(_stop_server)


def _stop_server() -> None:
    """At exit, stop the forkserver and the resource tracker it brought, and wait for both, so that no
    process of this harness outlives it (left alone, each notices its parent's exit only when the kernel
    closes the parent's end of its pipe, then takes its own time to exit). The stdlib's own stops, meant for
    its tests; where absent, the pipes do it."""
    for owner in (multiprocessing.forkserver._forkserver, multiprocessing.resource_tracker._resource_tracker):
        stop = getattr(owner, "_stop", None)
        if stop is not None:
            stop()


def _set(var: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


def _child(what: tuple[Any, ...], log_path: str, env: dict[str, str], cwd: str) -> None:
    """In the forked process: a session of its own, the caller's environment, cwd and log, then the run
    (`what`: ("launch", world, log_dir, worker module, worker_args) or ("cli", harness arguments))."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    if what[0] == "cli":
        code = importlib.import_module(CLI_MODULE).main(what[1])
    elif what[1] == 1:
        code = importlib.import_module(what[3]).main(what[4])
    else:
        code = importlib.import_module(FORKRUN_MODULE).launch_ranks(what[1], Path(what[2]) if what[2] else None,
                                                                    what[4], what[3])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
