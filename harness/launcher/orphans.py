"""No process of a `harness run` outlives it, however it ends (SIGKILL included).

`harness run` marks itself the owner: HARNESS_RUN_OWNER=PID:START (its pid and the kernel's start time of that
pid, so a reused pid is never taken for it) in its environment, which every process it starts inherits (the
forkserver and its resource tracker, launchers and ranks, engine servers of every kind, their own children). It
then starts a guardian in a session of its own (`python -m harness.launcher.orphans TOKEN`, no torch): when the owner
is gone, the guardian kills every process of this user whose environment carries the owner's mark, and exits. A
server kept on purpose (--keep-servers) is started without the mark. Whatever survives anyway (the guardian killed
too) is found by its mark and its dead owner: `harness cache servers` lists it and `--stop` stops it.
Linux (/proc); elsewhere nothing is marked and nothing is found."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OWNER_ENV = "HARNESS_RUN_OWNER"
PROC = Path("/proc")
GUARD_POLL_S = 0.5


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks after boot, /proc/PID/stat field 22), None when it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # the fields after "pid (comm) ": field 3 is index 0


def owner_token(pid: int) -> str | None:
    start = _start_time(pid)
    return None if start is None else f"{pid}:{start}"


def owner_alive(token: str) -> bool:
    pid, _, start = token.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == start


@dataclass(frozen=True)
class Marked:
    """A process carrying an owner's mark."""

    pid: int
    owner: str
    command: str

    @property
    def owner_pid(self) -> int:
        return int(self.owner.partition(":")[0])


def marked_processes() -> list[Marked]:
    """This user's processes whose environment holds HARNESS_RUN_OWNER (this process left out)."""
    found = []
    key = f"{OWNER_ENV}=".encode()
    for entry in PROC.glob("[0-9]*") if PROC.is_dir() else ():
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():  # another user's processes are never ours to list or stop
                continue
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # another user's, or gone meanwhile
            continue
        for item in environ.split(b"\0"):
            if item.startswith(key):
                command = " ".join(cmdline.decode(errors="replace").split("\0")).strip()
                found.append(Marked(pid, item[len(key):].decode(errors="replace"), command))
                break
    return found


def orphans() -> list[Marked]:
    """Marked processes whose owner is gone: what a hard-killed run left behind."""
    return [m for m in marked_processes() if not owner_alive(m.owner)]


def kill(processes: Sequence[Marked]) -> list[Marked]:
    """SIGKILL each of `processes`; those that were still there."""
    killed = []
    for m in processes:
        try:
            os.kill(m.pid, signal.SIGKILL)
            killed.append(m)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def guard_this_process() -> None:
    """Mark this process as the owner of every process it starts from now on, and start its guardian (once)."""
    token = owner_token(os.getpid())
    if token is None or os.environ.get(OWNER_ENV) == token:
        return
    os.environ[OWNER_ENV] = token
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}  # the guardian is no process of the run
    subprocess.Popen([sys.executable, "-m", "harness.launcher.orphans", token], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
                     close_fds=True)


def unmarked_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the owner's mark: for a process meant to outlive the run (a kept engine server)."""
    return {k: v for k, v in env.items() if k != OWNER_ENV}


def main(argv: Sequence[str] | None = None) -> int:
    """The guardian: wait for the owner `TOKEN` to end, then kill what carries its mark (until nothing does)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m harness.launcher.orphans PID:START", file=sys.stderr)
        return 2
    token = args[0]
    while owner_alive(token):
        time.sleep(GUARD_POLL_S)
    for _ in range(20):  # a process forked while the others died is found on the next pass
        if not kill([m for m in marked_processes() if m.owner == token]):
            return 0
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
