"""Exclusive ownership of an output folder for the whole of a command that writes results into it (`harness run`,
`harness report`): an advisory lock (flock) on FOLDER/.harness-owner.lock, which also records the owner's pid and
command, so a second writer is refused at once naming who holds the folder. The kernel drops the lock when its
process dies, however it dies (SIGKILL included), so a stale lock file never blocks a later run."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from harness.core.errors import ConfigError

LOCK_FILE = ".harness-owner.lock"


def _owner(fd: int) -> str:
    """The holder's record as a user reads it: pid, host, start time and command."""
    try:
        raw = os.pread(fd, 65536, 0)
        owner = json.loads(raw.decode("utf-8"))
        return (f"pid {owner['pid']} on {owner['host']}, started {owner['started']}: "
                f"{owner['command']}")
    except (OSError, ValueError, KeyError, TypeError):  # the holder is still writing its record
        return "another process (its record is not written yet)"


@contextlib.contextmanager
def hold_folder(folder: Path, command: str, flag: str = "--out") -> Iterator[None]:
    """Hold `folder` (created if absent) for this process until the block ends; a folder another process holds is
    a ConfigError naming that process and its command. The lock file is removed when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _owner(fd)
            os.close(fd)
            raise ConfigError(f"{flag} {folder} is in use by {holder}; two commands never write into one folder: "
                              f"wait for it to finish, or give another folder") from None
        try:  # the file may have been removed (and made again) by the holder that just finished: lock the new one
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
