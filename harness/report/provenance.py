"""Provenance of a run: versions, commit, device, dtypes and seeds, as results.json stores it."""

from __future__ import annotations

import platform
import socket
import subprocess
from importlib import metadata
from typing import Any

from harness import __version__
from harness.core.paths import PROJECT_ROOT


def git_commit() -> str:
    """The harness checkout's commit, with '-dirty' for uncommitted changes; 'unknown' outside git."""
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True,
                          timeout=10, check=True)
    return done.stdout.strip()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def collect_provenance(command: str, device: str, dtypes: list[str], seeds: list[int]) -> dict[str, Any]:
    """The provenance block of results.json for a run started by `command` on `device`."""
    return {"harness_version": __version__, "git_commit": git_commit(), "torch_version": _version("torch"),
            "python": platform.python_version(), "device": device, "dtypes": list(dtypes),
            "seeds": list(seeds), "command": command, "hostname": socket.gethostname()}
