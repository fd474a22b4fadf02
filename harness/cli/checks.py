"""Checks of command-line values that must hold before anything runs (each failure: one line, exit 2)."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.core.errors import ConfigError
from harness.core.limits import MAX_SEED, REPORTS_MIN_BYTES, RUN_DIR_MIN_BYTES, free_bytes
from harness.records.results import RESULTS_FILE


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, GiB)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a finite number > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number > 0 (tokens, MiB)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give an integer > 0") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer > 0")
    return value


def bounded_float(maximum: float, unit: str) -> Callable[[str], float]:
    """argparse type: a finite number > 0 and <= `maximum` (named with its `unit` in the error)."""
    def parse(text: str) -> float:
        value = positive_float(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is more than the maximum, {maximum:g} {unit}")
        return value
    return parse


def bounded_int(maximum: int, unit: str) -> Callable[[str], int]:
    """argparse type: a whole number > 0 and <= `maximum` (named with its `unit` in the error)."""
    def parse(text: str) -> int:
        value = positive_int(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is more than the maximum, {maximum} {unit}")
        return value
    return parse


def seed_int(text: str) -> int:
    """argparse type: a seed, a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; seeds are integers >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; seeds are integers >= 0")
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} is too large; seeds are integers from 0 to {MAX_SEED} (2**63 - 1)")
    return value


NAME_MAX_BYTES = 255    # one path component (Linux, macOS: NAME_MAX)
PATH_MAX_BYTES = 4096   # a whole path (Linux: PATH_MAX)


def require_path_lengths(path: Path, flag: str) -> None:
    """Every component of `path` within NAME_MAX_BYTES and the whole within PATH_MAX_BYTES (the file system's
    limits), else one ConfigError naming the flag, the length and the limit: never an OSError later."""
    whole = len(os.fsencode(str(path.absolute())))
    if whole > PATH_MAX_BYTES:
        raise ConfigError(f"{flag} {str(path)[:60]}...: the path is {whole} bytes long; at most {PATH_MAX_BYTES}")
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > NAME_MAX_BYTES:
            raise ConfigError(f"{flag} {str(path)[:60]}...: the name {part[:40]}... is {size} bytes long; a file or "
                              f"folder name holds at most {NAME_MAX_BYTES} bytes")


def require_writable_dir(path: Path, flag: str) -> None:
    """`path` is, or can be created as, a folder this process can write; checked by writing a probe
    file into it (or into its nearest existing parent, which is left as it was)."""
    require_path_lengths(path, flag)
    probe_in = path
    while not probe_in.exists():
        if probe_in.parent == probe_in:
            break
        probe_in = probe_in.parent
    if probe_in.exists() and not probe_in.is_dir():
        where = "is a file" if probe_in == path else f"lies under the file {probe_in}"
        raise ConfigError(f"{flag} {path} {where}; give a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".harness-write-probe-", dir=probe_in)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ConfigError(f"{flag} {path} is not writable ({exc.strerror or exc} in {probe_in}); "
                          f"give a folder you can write to") from None


def require_store_folder(path: Path, flag: str, writes: bool) -> None:
    """A store folder another process fills (P/D's KV store): not a file, nor under one; a writer's is writable."""
    if writes:
        require_writable_dir(path, flag)
        return
    require_path_lengths(path, flag)
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == path else f"lies under the file {probe}"
        raise ConfigError(f"{flag} {path} {where}; give a folder (the KV store both servers share)")


@contextmanager
def writing_into(folder: Path, flag: str) -> Iterator[None]:
    """Writing the output files of a command that runs nothing (report, signoff) into `folder`: an OSError (a full
    disk, a file system turned read-only) is one ConfigError naming the folder and the reason. The files are written
    atomically, so each one on disk is complete."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"{flag} {folder}: cannot write its files ({exc.strerror or exc}; "
                          f"{free_bytes(folder)} bytes free); free some space or give another {flag}") from None


def require_no_results(folder: Path, flag: str) -> None:
    """Results are never written over: a folder that holds a results.json (an earlier run's, a merge's) is refused."""
    existing = folder / RESULTS_FILE
    if existing.exists():
        raise ConfigError(f"{flag} {folder} already holds results ({existing}); results are never written over: "
                          f"give a new folder, or move that one away first")


def require_free_space(folder: Path, flag: str, cells: int) -> None:
    """Refuse a run whose --out disk clearly cannot hold it: less free than a lower bound of what `cells`
    launched cells and the reports need (harness/core/limits.py)."""
    need = cells * RUN_DIR_MIN_BYTES + REPORTS_MIN_BYTES
    free = free_bytes(folder)
    if free < need:
        raise ConfigError(f"{flag} {folder}: {free} bytes free on its disk; {cells} cell(s) and the reports need "
                          f"at least {need} bytes; free some space or give a folder on a larger disk")


def require_device(device: str, world_sizes: list[int]) -> None:
    """--device cuda needs a CUDA build of torch with as many GPUs as the largest topology's ranks."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--device cuda, but torch {torch.__version__} sees no CUDA device "
                          f"(torch.cuda.is_available() is False); use --device cpu or install a CUDA build of torch")
    need, have = max(world_sizes, default=1), torch.cuda.device_count()
    if need > have:
        raise ConfigError(f"--device cuda: the matrix needs {need} GPUs per launch, this machine has {have}; "
                          f"pick topologies with tp <= {have}")


def require_launch_settings(env: dict[str, str]) -> None:
    """HARNESS_LAUNCHER, HARNESS_THREADS_PER_PROCESS and HARNESS_SHM_COLLECTIVES, checked before anything runs."""
    from harness.engine.runtime.shm_group import SHM_ENV, enabled
    from harness.launcher.launch import LAUNCHER_ENV, THREADS_ENV, launcher_choice, threads_per_process

    launcher_choice("cpu", False, env.get(LAUNCHER_ENV))
    threads_per_process(1, 1, env.get(THREADS_ENV))
    enabled(env.get(SHM_ENV))
