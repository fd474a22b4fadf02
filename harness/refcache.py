"""The reference cache: reference and noise runs keyed by content, so a nightly pays for each
(model, seed, settings) once and an engineer's rerun of one cell reuses it.

An entry is a run directory under CACHE/runs/, named for humans (`{engine-}{model}-{topology}-{dtype}...`)
and keyed by a hash of what produces its artifacts: the job (minus its output folder, commit and
timeouts) and the backend's identity (engine, version, weights, engine code). Editing a check keeps
every entry; editing the engine retires them. Runs are launched into a private staging folder
(`NAME.PID.partial`) and renamed into place, so processes sharing a cache never write into one folder;
an entry that cannot be read or breaks the artifacts contract is launched again, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

from harness.artifacts import RunArtifacts, read_run
from harness.backends.registry import DEFAULT_ENGINE
from harness.contract import Backend, Job
from harness.errors import HarnessError, RunError
from harness.validate import load_run, validate_artifacts

PARTIAL_SUFFIX = ".partial"  # a reference run still being written into the cache (renamed when done)
_UNKEYED = ("out_dir", "git_commit", "collective_timeout_s")  # job fields that do not change the artifacts
__all__ = ["PARTIAL_SUFFIX", "ReferenceCache", "ReferenceFailed", "partial_dirs"]


class ReferenceFailed(HarnessError):
    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir


def partial_dirs(cache_dir: Path, pid: int | None = None) -> list[Path]:
    """The staging folders in the reference cache: all of them, or only those of process `pid`."""
    pattern = f"*.{pid}{PARTIAL_SUFFIX}" if pid is not None else f"*{PARTIAL_SUFFIX}"
    return sorted(p for p in (cache_dir / "runs").glob(pattern) if p.is_dir())


class ReferenceCache:
    """Reference-side runs of one backend in one cache folder."""

    def __init__(self, cache_dir: Path, backend: Backend, timeout_s: float,
                 progress: Callable[[str], None] = print) -> None:
        self.cache_dir = cache_dir
        self.backend = backend
        self.timeout_s = timeout_s
        self.progress = progress

    def key(self, job: Job, repeat: bool = False) -> str:
        """What identifies `job`'s artifacts: a hash of the job (minus its output folder, commit and
        timeouts) and the backend's identity; `repeat` keys an independent second run."""
        content = {k: v for k, v in job.to_dict().items() if k not in _UNKEYED}
        return hashlib.sha256(json.dumps({"job": content, "backend": self.backend.identity(job), "repeat": repeat},
                                         sort_keys=True, default=str).encode()).hexdigest()

    def entry(self, job: Job, name: str, repeat: bool = False) -> Path:
        """The run directory of `job` (its out_dir ignored); `repeat` keys an independent second run."""
        engine = "" if self.backend.name == DEFAULT_ENGINE else f"{self.backend.name}-"
        return self.cache_dir / "runs" / f"{engine}{name}-{self.key(job, repeat)[:16]}"

    def get(self, job: Job, name: str, label: str, repeat: bool = False) -> RunArtifacts:
        """The cached run of `job`, or launched now and cached; ReferenceFailed when it fails."""
        run_dir = self.entry(job, name, repeat)
        cached = self._read(run_dir, label)
        if cached is not None:
            return cached
        self.progress(f"  {label}: running")
        staging = run_dir.with_name(f"{run_dir.name}.{os.getpid()}{PARTIAL_SUFFIX}")
        result = self.backend.run(replace(job, out_dir=str(staging)), self.timeout_s)
        model, dtype = job.model.name, job.dtype or job.model.dtype
        if not result.ok:
            raise ReferenceFailed(f"reference run of {model} ({dtype}) failed: {result.error}", staging)
        try:
            staging.rename(run_dir)  # only successful runs ever sit at run_dir
        except OSError:  # another run renamed its identical result into place first
            shutil.rmtree(staging, ignore_errors=True)
        run, problems = load_run(run_dir)
        if run is not None:
            problems = validate_artifacts(run)
        if run is None or problems:
            raise ReferenceFailed(f"reference run of {model} ({dtype}) breaks the artifacts contract: "
                                  f"{problems[0]}", run_dir)
        return run

    def _read(self, run_dir: Path, label: str) -> RunArtifacts | None:
        """A usable cached entry (marked as used now, for `harness cache prune`), or None after removing
        an unusable one."""
        if not (run_dir / "manifest.json").exists():
            return None
        try:
            cached = read_run(run_dir)
        except RunError as exc:  # a damaged cache entry is launched again, never trusted
            self.progress(f"  {label}: cache entry unreadable ({exc}); running again")
            cached = None
        if cached is not None and cached.ok and not validate_artifacts(cached):
            self.progress(f"  {label}: cached ({run_dir})")
            os.utime(run_dir)
            return cached
        shutil.rmtree(run_dir, ignore_errors=True)
        return None
