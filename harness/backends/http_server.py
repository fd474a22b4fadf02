"""One engine server process: started in its own process group on a free loopback port, its output
kept in a log file, ready when its health endpoint answers (bounded), stopped with everything it
started (on cell end, error, Ctrl-C and SIGTERM: the caller's `with` block exits). A server that logs
that it cannot bind its address fails at once, naming the line, whether it exits or hangs."""

from __future__ import annotations

import os
import re
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from harness.errors import RunError
from harness.launcher import forkserver
from harness.launcher.launch import WAIT_POLICY_VAR, Process, free_port, stop_process_tree, wait_policy

__all__ = ["Server", "ServerError", "bind_failure", "free_port", "log_tail", "running_server", "wait_ready"]

LOG_TAIL_LINES = 40
POLL_S = 0.5
FIRST_POLL_S, FIRST_POLLS_FOR_S = 0.1, 5.0  # a warm harness-serve answers in about a second: look often at first


# a server's own words for an address it cannot bind: harness serve's error line, uvicorn's (vLLM, SGLang)
BIND_FAILURE = re.compile(r"cannot listen on \S+:|error while attempting to bind on address", re.IGNORECASE)


def bind_failure(text: str) -> str | None:
    """The first line of `text` saying the server cannot bind its address, stripped; None when none does."""
    match = BIND_FAILURE.search(text)
    if match is None:
        return None
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.end())
    return text[start:end if end >= 0 else len(text)].strip()


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServerError(RunError):
    """The server did not come up (exited, or not healthy in time); carries its log tail."""

    def __init__(self, message: str, tail: str) -> None:
        super().__init__(message)
        self.tail = tail


@dataclass
class Server:
    base_url: str
    log_path: Path
    proc: Process | None = None  # None: attached to a server someone else runs

    def tail(self) -> str:
        return log_tail(self.log_path) if self.proc is not None else ""

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_since(self, offset: int) -> tuple[str, int]:
        """What the log gained after byte `offset`, and the new offset (whole lines only)."""
        if self.proc is None:
            return "", offset
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return "", offset
        complete = data[:data.rfind(b"\n") + 1]
        return complete.decode(errors="replace"), offset + len(complete)


def wait_ready(server: Server, health: str, timeout_s: float) -> float:
    """Poll `health` until it answers 200; returns the seconds it took. A server that exits, logs that it
    cannot bind its address, or stays unhealthy for `timeout_s` is a ServerError with its log tail."""
    start = time.monotonic()
    offset = 0
    with httpx.Client(base_url=server.base_url, timeout=5.0) as client:
        while True:
            code = server.exited()
            new, offset = server.log_since(offset)
            if code is not None:
                new += server.log_since(offset)[0]
            line = bind_failure(new)
            if code is not None:
                why = f": {line}" if line else ""
                raise ServerError(f"engine server exited with code {code} before it was ready{why}", server.tail())
            if line is not None:
                raise ServerError(f"engine server cannot bind its address: {line}", server.tail())
            try:
                if client.get(health).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            if time.monotonic() - start > timeout_s:
                raise ServerError(f"engine server not ready after {timeout_s:.0f} s ({health} never answered 200)",
                                  server.tail())
            time.sleep(FIRST_POLL_S if time.monotonic() - start < FIRST_POLLS_FOR_S else POLL_S)


@contextmanager
def running_server(argv: list[str], env: dict[str, str], log_path: Path, base_url: str) -> Iterator[Server]:
    """Start `argv` in a new session (its own process group), output to `log_path`; always stopped on exit.
    `harness ...` of this interpreter (the harness-serve engines) is forked warm from the launch
    forkserver (harness/launcher/forkserver.py) rather than started as a fresh interpreter."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    harness_args = forkserver.harness_command(argv)
    warm_env = {**full_env, WAIT_POLICY_VAR: wait_policy(full_env)}  # as a launch's: passive unless set
    proc: Process
    if harness_args is not None and forkserver.usable(warm_env):
        proc = forkserver.start_command(harness_args, log_path, warm_env)
    else:
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=full_env)
            except OSError as exc:
                raise ServerError(f"cannot start engine server {argv[0]}: {exc.strerror}", "") from exc
    try:
        yield Server(base_url=base_url, log_path=log_path, proc=proc)
    finally:
        stop_process_tree(proc)
