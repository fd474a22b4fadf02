"""One engine server process: started in its own process group on a free loopback port, its output
kept in a log file, ready when its health endpoint answers (bounded), stopped with everything it
started (on cell end, error, Ctrl-C and SIGTERM: the caller's `with` block exits). A server that logs
that it cannot bind its address fails at once, naming the line, whether it exits or hangs.

The port is picked free, then bound by the server: another process may take it in between (a busy CI box,
two shards on one machine). `started_server` then starts the server again on another free port, up to
BIND_ATTEMPTS launches, for every engine template: the bind failure is read from the server's own log
(harness serve's and uvicorn's words, BIND_FAILURE)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx

from harness.core.errors import RunError
from harness.launcher import forkserver
from harness.launcher.launch import WAIT_POLICY_VAR, Process, descendants, free_port, stop_process_tree, wait_policy
from harness.launcher.orphans import unmarked_env

__all__ = ["BIND_ATTEMPTS", "AddressTaken", "Server", "ServerError", "bind_failure", "clean_reason", "free_port",
           "launch_ready", "log_line", "log_tail", "pid_alive", "root_cause", "running_server", "server_death",
           "start_server", "stop_server", "wait_ready"]

# a server's extra environment over the harness's own: None withholds an inherited variable (a reference server
# never gets the engine-side fault variables: harness/backends/http/backend.py, as_reference)
ServerEnv = dict[str, "str | None"]
LOG_TAIL_LINES = 40
CAUSE_CONTEXT_LINES = 30  # lines of the root cause's traceback kept as the error's context
STOP_GRACE_S = 45.0  # a server's leader gets this long to stop its own processes before the group is killed
POLL_S = 0.5
DEATH_GRACE_S = 3.0  # a request that failed waits this long for the server's exit to show (a killed server)
BIND_ATTEMPTS = 4  # launches of one server, each on a fresh free port, while its port is taken before it binds
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


# "(EngineCore pid=123) " / "(Worker_TP1 pid=9) ": vLLM's prefix of a child process's lines
_PROC_PREFIX = re.compile(r"^\((?:[A-Za-z0-9_]+ )?pid=\d+\)\s?")
_TRACEBACK = "Traceback (most recent call last):"
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b(?::|$)")
_ERROR_LINE = re.compile(r"\bERROR\b|\bCRITICAL\b|\bFATAL\b|^(?:error|fatal):", re.IGNORECASE)


_PYDANTIC_TAIL = re.compile(r"\s*\[type=[\w.]+, input_value=.*$")
_PYDANTIC_KIND = re.compile(r"(^|: )Value error, ")


def clean_reason(line: str) -> str:
    """A log line as a reason: stripped, without pydantic's "[type=..., input_value=..., input_type=...]" tail
    (a repr of the whole config, cut mid-word) and its "Value error, " label."""
    return _PYDANTIC_KIND.sub(r"\1", _PYDANTIC_TAIL.sub("", line.strip())).strip()


# "ERROR 12-01 22:04:33 [multiproc_executor.py:1063] ": vLLM's logger header
_LOG_HEADER = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ")


def _bare(line: str) -> str:
    return _LOG_HEADER.sub("", _PROC_PREFIX.sub("", line)).rstrip()


def log_line(line: str) -> str:
    """A server log line as a reason: without vLLM's "(Proc pid=N)" prefix, as clean_reason."""
    return clean_reason(_bare(line))


# a process's native crash report (no Python traceback of its own): the faulthandler / c10 / vLLM CPU signal
# handlers' first lines, then the native frames ('  File "/src/x.cpp", line 242, in f')
_NATIVE_CRASH = re.compile(r"Segfault encountered|Fatal Python error: (?:Segmentation fault|Aborted|Bus error|"
                           r"Floating point exception|Illegal instruction)|\bSIG(?:SEGV|ABRT|BUS|FPE|ILL)\b")
_NATIVE_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_DIED = re.compile(r"Worker proc \S+ died unexpectedly")


def _native_crash(lines: list[str]) -> tuple[int, str] | None:
    """(index, reason) of the first native crash report in `lines` (bare): its marker and its first frame in a
    source file other than the C library's signal code, e.g. "Segfault encountered at csrc/cpu/x.cpp:242 in f";
    the line saying which worker died is added where the log has one."""
    found = next(((i, m) for i, line in enumerate(lines) if (m := _NATIVE_CRASH.search(line))), None)
    if found is None:
        return None
    start, marker = found
    reason = marker.group(0)
    for line in lines[start + 1:start + 40]:
        frame = _NATIVE_FRAME.match(line)
        if frame and "sysdeps" not in frame["path"] and frame["path"] != "<unknown>":
            reason += f" at {frame['path']}:{frame['line']} in {frame['func'].strip()[:100]}"
            break
    died = next((_DIED.search(line) for line in lines[start:] if _DIED.search(line)), None)
    return start, reason + (f" ({died.group(0)})" if died else "")


def root_cause(text: str) -> tuple[str, str] | None:
    """The root cause of a crashed server in its log `text`: (the line, its context). A native crash report
    (a segmentation fault and its first source frame: _native_crash) before the first traceback is the cause
    (the tracebacks after it are its consequences: "RuntimeError: cancelled"). Otherwise the line is the
    exception of the first traceback with its own continuation lines (pydantic's "  Value error, ..."), as
    clean_reason gives it: a server that re-raises it later ("See root cause above") is not the cause.
    Without a traceback, the first error line. The context is the error line logged just before that
    traceback ("WorkerProc hit an exception.") and the traceback (or the lines around the error line), at
    most CAUSE_CONTEXT_LINES lines, vLLM's "(Proc pid=N)" prefixes and logger headers removed. None when the
    log has neither."""
    raw = text.splitlines()
    lines = [_bare(line) for line in raw]
    start = next((i for i, line in enumerate(lines) if line.strip() == _TRACEBACK), None)
    native = _native_crash(lines)
    if native is not None and (start is None or native[0] < start):
        at = native[0]
        return native[1], "\n".join(lines[at:at + CAUSE_CONTEXT_LINES])
    if start is not None:
        end = next((j for j in range(start + 1, len(lines)) if _EXCEPTION_LINE.match(lines[j])), None)
        if end is not None:
            more = 0  # the exception's own continuation lines (pydantic's "  Value error, ...")
            while (more < 3 and end + more + 1 < len(lines) and lines[end + more + 1].startswith("  ")
                   and lines[end + more + 1].strip() and "further information" not in lines[end + more + 1]):
                more += 1
            line = ": ".join([lines[end].strip().rstrip(":")] + [lines[end + k].strip() for k in range(1, more + 1)])
            first = start - 1 if start and _ERROR_LINE.search(_PROC_PREFIX.sub("", raw[start - 1])) else start
            block = lines[first:end + more + 1]
            keep = CAUSE_CONTEXT_LINES
            context = block if len(block) <= keep else [*block[:2], "  ...", *block[-keep + 3:]]
            return clean_reason(line), "\n".join(context)
    for i, line in enumerate(raw):
        if _ERROR_LINE.search(_PROC_PREFIX.sub("", line)) and "DeprecationWarning" not in line:
            return clean_reason(lines[i]), "\n".join(lines[max(0, i - 3):i + CAUSE_CONTEXT_LINES - 3])
    return None


_PROC_NAME = re.compile(r"^\((?P<name>(?:[A-Za-z0-9_]+ )?pid=\d+)\)")


def process_causes(text: str) -> list[str]:
    """Per process of a multi-process server's log (vLLM's "(Worker_TP1 pid=N)" prefixes), in order of first
    appearance: "NAME: its root cause", or "NAME: no error line (last: ...)" for a process that logged none (a
    worker killed without a word: its peers then report only "Connection closed by peer"). Empty for a log
    of fewer than two processes."""
    by_proc: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = _PROC_NAME.match(line)
        if match:
            by_proc.setdefault(match.group("name"), []).append(line)
    if len(by_proc) < 2:
        return []
    out = []
    for name, lines in by_proc.items():
        cause = root_cause("\n".join(lines))
        last = next((log_line(line) for line in reversed(lines) if log_line(line)), "")
        out.append(f"{name}: {cause[0]}" if cause else f"{name}: no error line (last: {last[:120]})")
    return out


def _with_processes(message: str, text: str) -> str:
    """`message` and, for a multi-process server, every process's own cause (process_causes)."""
    causes = process_causes(text)
    return f"{message}; per process: " + " | ".join(causes) if causes else message


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


class AddressTaken(ServerError):
    """The server logged that it cannot bind its address (exited or not)."""


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
                _exited(server, code, line)
            if line is not None:
                raise AddressTaken(f"engine server cannot bind its address: {line}", server.tail())
            try:
                if client.get(health).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            if time.monotonic() - start > timeout_s:
                raise ServerError(f"engine server not ready after {timeout_s:.0f} s ({health} never answered 200)",
                                  server.tail())
            time.sleep(FIRST_POLL_S if time.monotonic() - start < FIRST_POLLS_FOR_S else POLL_S)


def _exited(server: Server, code: int, bind_line: str | None) -> None:
    """The ServerError of a server that exited before it was ready: its root cause (the bind failure, the
    first traceback's exception, the first error line) as the message, that cause's context as the tail."""
    where = f"server exited with code {code} before it was ready"
    if bind_line:
        raise AddressTaken(f"engine {where}: {bind_line}", server.tail())
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        text = ""
    cause = root_cause(text)
    if cause is None:
        raise ServerError(_with_processes(f"engine {where} (no error line in {server.log_path.name})", text),
                          server.tail())
    raise ServerError(_with_processes(f"{cause[0]} ({where}; {server.log_path.name})", text), cause[1])


def server_death(server: Server, exc: Exception, grace_s: float = DEATH_GRACE_S) -> ServerError | None:
    """The ServerError of a server that died while it was serving (a request failed with `exc`: "Connection
    refused", a dropped connection): how it ended (killed by a signal, its exit code), its root cause from the log
    and its log tail; None when it still runs (the request's own error stands) or it is not the harness's. Only a
    lost connection waits up to `grace_s` for the exit to show."""
    if server.proc is None:
        return None
    lost = isinstance(exc.__cause__, httpx.TransportError) and not isinstance(exc.__cause__, httpx.TimeoutException)
    deadline = time.monotonic() + (grace_s if lost else 0.0)
    while (code := server.exited()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if code is None:
        return None
    how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else \
        f"exited with code {code}"
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        text = ""
    cause = root_cause(text)
    said = f"; its log: {cause[0]}" if cause else ""
    return ServerError(_with_processes(f"engine server died while serving ({how}{said}); the request got: {exc}",
                                       text), server.tail())


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return state not in ("Z", "X")


def stop_server(proc: Process, grace_s: float = STOP_GRACE_S) -> None:
    """Stop an engine server and everything it started. The leader alone gets SIGTERM first and up to
    `grace_s` to stop its own processes (vLLM's API server shuts its engine core and workers down, and they
    unlink their shared memory, tp x 4 MiB vllm_dist_* files in /dev/shm, which a SIGKILL leaves behind),
    then its processes get what is left of the grace to exit; then the whole tree is stopped as a launch's
    (SIGTERM to every group, SIGKILL)."""
    children = descendants(proc.pid)
    deadline = time.monotonic() + grace_s
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    stop_process_tree(proc)
    for pid in children:  # reparented ones outside the group, if any
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def start_server(argv: list[str], env: ServerEnv, log_path: Path, base_url: str, warm: bool = True) -> Server:
    """Start `argv` in a new session (its own process group), output to `log_path`; the caller stops it
    (stop_server). `harness ...` of this interpreter (the harness-serve engines) is forked warm from the launch
    forkserver (harness/launcher/forkserver.py) rather than started as a fresh interpreter, unless `warm` is
    false (a server meant to outlive this process)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}  # None: withheld from the server
    if not warm:  # meant to outlive this process (a kept server): not one of the run's, not killed with it
        full_env = unmarked_env(full_env)
    harness_args = forkserver.harness_command(argv)
    warm_env = {**full_env, WAIT_POLICY_VAR: wait_policy(full_env)}  # as a launch's: passive unless set
    proc: Process
    if warm and harness_args is not None and forkserver.usable(warm_env):
        proc = forkserver.start_command(harness_args, log_path, warm_env)
    else:
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=full_env)
            except OSError as exc:
                raise ServerError(f"cannot start engine server {argv[0]}: {exc.strerror}", "") from exc
    return Server(base_url=base_url, log_path=log_path, proc=proc)


@contextmanager
def running_server(argv: list[str], env: ServerEnv, log_path: Path, base_url: str) -> Iterator[Server]:
    """start_server, always stopped on exit."""
    server = start_server(argv, env, log_path, base_url)
    assert server.proc is not None
    try:
        yield server
    finally:
        stop_server(server.proc)


def launch_ready(command: Callable[[int], tuple[list[str], ServerEnv]], log_path: Path, host: str,
                 health: str, timeout_s: float, warm: bool = True,
                 on_start: Callable[[Server, list[str]], None] | None = None) -> tuple[Server, float, list[str]]:
    """The server `command(port)` gives (argv, extra environment), started on a free port of `host` and ready:
    (server, seconds to ready, its argv); the caller stops it (stop_server). A port another process took between
    its pick and the server's bind (the server logs that it cannot bind it) is picked again, up to BIND_ATTEMPTS
    launches within `timeout_s`; the last launch's log stays in `log_path`. Any other startup failure is the
    ServerError of wait_ready, the server stopped. `on_start(server, argv)` is told of each launch before its wait."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, BIND_ATTEMPTS + 1):
        port = free_port(host)
        argv, env = command(port)
        log_path.unlink(missing_ok=True)  # a launch's log is its own (a warm fork appends to the file)
        server = start_server(argv, env, log_path, f"http://{host}:{port}", warm)
        assert server.proc is not None
        try:
            if on_start is not None:
                on_start(server, argv)
            return server, wait_ready(server, health, max(1.0, deadline - time.monotonic())), argv
        except AddressTaken as exc:
            stop_server(server.proc)
            if attempt == BIND_ATTEMPTS or time.monotonic() >= deadline:
                raise AddressTaken(f"{exc} ({attempt} launch(es), each on another free port)", exc.tail) from None
        except BaseException:
            stop_server(server.proc)
            raise
    raise AssertionError("unreachable: the last attempt returns or raises")
