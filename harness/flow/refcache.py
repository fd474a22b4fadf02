"""The reference cache: reference and noise runs keyed by content, so a nightly pays for each
(model, seed, settings) once and an engineer's rerun of one cell reuses it.

An entry is a run directory under CACHE/runs/, named for humans (`{engine-}{model}-{topology}-{dtype}...`)
and keyed by a hash of what produces its artifacts: the job (minus its output folder, commit and
timeouts) and the backend's identity (engine, version, weights, engine code). Editing a check keeps
every entry; editing the engine retires them.

Writing: a run is launched into a private staging folder (`NAME.PID.partial`), validated against the
artifacts contract, given `checksums.json` (the sha256 of every other file of the entry) and renamed
into place, so only complete entries ever sit at their name. Reading: the checksums are verified
first; an entry whose files do not match them (or that has none), cannot be read or breaks the
contract is launched again, never trusted, and the progress line says why.

A launch that fails leaves no staging folder: its log tails are kept in the error (the cell's ERROR shows
them) and the folder is removed; staging folders of processes that died (SIGKILL, a power cut) are removed at
the next lookup of any process using the cache.

Two processes at once: looking up and launching one key happens under an exclusive lock
(`CACHE/locks/NAME.lock`, fcntl.flock, released by the kernel when its holder exits), so a second
process waits for the first one's run and then reads it from the cache instead of paying for it again.
Where the lock is not honoured (a file system without flock), the rename still decides: the loser
verifies the winner's entry, uses it and removes its own staging folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from harness.backends.registry import DEFAULT_ENGINE
from harness.core.errors import HarnessError, RunError
from harness.core.jsonio import write_json
from harness.records.artifacts import RunArtifacts, read_run
from harness.records.contract import Backend, Job
from harness.records.validate import load_run, validate_artifacts

PARTIAL_SUFFIX = ".partial"  # a reference run still being written into the cache (renamed when done)
CHECKSUMS_FILE = "checksums.json"  # {relative path: sha256} of every other file of an entry
LOCKS_DIR = "locks"  # CACHE/locks/NAME.lock: one (empty) lock file per key ever launched
_UNKEYED = ("out_dir", "git_commit", "collective_timeout_s")  # job fields that do not change the artifacts
__all__ = ["CHECKSUMS_FILE", "PARTIAL_SUFFIX", "ReferenceCache", "ReferenceFailed", "checksum_problem",
           "file_checksums", "partial_dirs"]


class ReferenceFailed(HarnessError):
    """A reference launch that failed: `run_dir` its entry (absent: a failed launch is not kept), `log_tails` the
    failed run's log tails by log name."""

    def __init__(self, message: str, run_dir: Path, log_tails: dict[str, str] | None = None,
                 refused: str = "") -> None:
        super().__init__(message)
        self.run_dir = run_dir
        self.log_tails = dict(log_tails or {})
        self.refused = refused  # the engine's own words when it refuses the reference (a SKIP, not an ERROR)


def partial_alive(staging: Path) -> bool:
    """Whether the process that writes the staging folder `staging` (NAME.PID.partial) still runs."""
    try:
        pid = int(staging.name.removesuffix(PARTIAL_SUFFIX).rsplit(".", 1)[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_partials(cache_dir: Path) -> list[Path]:
    """Remove the staging folders whose process is gone; the ones removed."""
    stale = [p for p in partial_dirs(cache_dir) if not partial_alive(p)]
    for staging in stale:
        shutil.rmtree(staging, ignore_errors=True)
    return stale


def partial_dirs(cache_dir: Path, pid: int | None = None) -> list[Path]:
    """The staging folders in the reference cache: all of them, or only those of process `pid`."""
    pattern = f"*.{pid}{PARTIAL_SUFFIX}" if pid is not None else f"*{PARTIAL_SUFFIX}"
    return sorted(p for p in (cache_dir / "runs").glob(pattern) if p.is_dir())


def file_checksums(run_dir: Path) -> dict[str, str]:
    """sha256 of every file under `run_dir` but the checksums file, by path relative to it."""
    sums = {}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(run_dir).as_posix()
        if rel != CHECKSUMS_FILE:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            sums[rel] = digest.hexdigest()
    return sums


def checksum_problem(run_dir: Path) -> str | None:
    """Why the files of `run_dir` do not match its checksums file ('tensors.safetensors',
    'no checksums.json', 'missing cases.json', 'unlisted file x'), or None when they all match."""
    try:
        recorded = json.loads((run_dir / CHECKSUMS_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {CHECKSUMS_FILE}"
    except (OSError, ValueError) as exc:
        return f"unreadable {CHECKSUMS_FILE}: {exc}"
    if not isinstance(recorded, dict):
        return f"unreadable {CHECKSUMS_FILE}: not a mapping"
    actual = file_checksums(run_dir)
    bad = [name for name, digest in sorted(recorded.items()) if name in actual and actual[name] != digest]
    bad += [f"missing {name}" for name in sorted(recorded) if name not in actual]
    bad += [f"unlisted file {name}" for name in sorted(actual) if name not in recorded]
    return ", ".join(bad) or None


class ReferenceCache:
    """Reference-side runs of one backend in one cache folder."""

    def __init__(self, cache_dir: Path, backend: Backend, timeout_s: float,
                 progress: Callable[[str], None] = print) -> None:
        self.cache_dir = cache_dir
        self.backend = backend
        self.timeout_s = timeout_s
        self.progress = progress
        self._swept = False

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
        if not self._swept:  # once per run: what killed processes left behind
            self._swept = True
            for staging in remove_stale_partials(self.cache_dir):
                self.progress(f"  removed {staging.name}: its process is gone (a launch that never finished)")
        with self._locked(run_dir, label):
            cached = self._read(run_dir, label)
            if cached is not None:
                return cached
            return self._launch(job, run_dir, label)

    @contextmanager
    def _locked(self, run_dir: Path, label: str) -> Iterator[None]:
        """Exclusive use of the key of `run_dir` among the processes sharing this cache."""
        locks = self.cache_dir / LOCKS_DIR
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{run_dir.name}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.progress(f"  {label}: another harness process is launching it; waiting for its entry")
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _launch(self, job: Job, run_dir: Path, label: str) -> RunArtifacts:
        """Launch `job` into a staging folder, check it, record its checksums and rename it to `run_dir`."""
        self.progress(f"  {label}: running")
        staging = run_dir.with_name(f"{run_dir.name}.{os.getpid()}{PARTIAL_SUFFIX}")
        result = self.backend.run(replace(job, out_dir=str(staging)), self.timeout_s)
        model, dtype = job.model.name, job.dtype or job.model.dtype
        if not result.ok:
            raise self._failed(f"reference run of {model} ({dtype}) failed: {result.error}", run_dir, staging,
                               result.log_tails, result.refused)
        run, problems = load_run(staging)
        if run is not None:
            problems = validate_artifacts(run)
        if run is None or problems:
            raise self._failed(f"reference run of {model} ({dtype}) breaks the artifacts contract: {problems[0]}",
                               run_dir, staging, (run.manifest.get("log_tails") or {}) if run is not None else {})
        write_checksums(staging)
        try:
            staging.rename(run_dir)  # only complete, checksummed runs ever sit at run_dir
        except OSError:  # another process (not honouring the lock) renamed its identical result first
            winner = self._read(run_dir, label, quiet=True)
            shutil.rmtree(staging, ignore_errors=True)
            if winner is None:
                raise ReferenceFailed(f"reference run of {model} ({dtype}): {run_dir} exists and is unusable",
                                      run_dir) from None
            self.progress(f"  {label}: another process cached it first; using its entry")
            return winner
        return replace(run, path=run_dir)

    @staticmethod
    def _failed(message: str, run_dir: Path, staging: Path, tails: dict[str, str],
                refused: str = "") -> ReferenceFailed:
        """The error of a failed launch, its log tails kept; its staging folder removed."""
        shutil.rmtree(staging, ignore_errors=True)
        return ReferenceFailed(message, run_dir, tails, refused)

    def _read(self, run_dir: Path, label: str, quiet: bool = False) -> RunArtifacts | None:
        """A usable cached entry (marked as used now, for `harness cache prune`), or None after removing
        an unusable one; `quiet` reads without the 'cached' line."""
        if not run_dir.exists():
            return None
        why = checksum_problem(run_dir)
        if why is not None:
            self.progress(f"  {label}: cached entry {run_dir.name} failed its checksum ({why}); launching again")
        else:
            try:
                cached: RunArtifacts | None = read_run(run_dir)
            except RunError as exc:  # a damaged cache entry is launched again, never trusted
                self.progress(f"  {label}: cache entry unreadable ({exc}); running again")
                cached = None
            problems = validate_artifacts(cached) if cached is not None and cached.ok else []
            if cached is not None and cached.ok and not problems:
                if not quiet:
                    self.progress(f"  {label}: cached ({run_dir})")
                os.utime(run_dir)
                return cached
            if cached is not None:
                why = problems[0] if problems else "the cached run did not finish"
                self.progress(f"  {label}: cached entry {run_dir.name} is unusable ({why}); launching again")
        shutil.rmtree(run_dir, ignore_errors=True)
        return None


def write_checksums(run_dir: Path) -> None:
    """Record the sha256 of every file of `run_dir` in its checksums file."""
    write_json(run_dir / CHECKSUMS_FILE, file_checksums(run_dir))
