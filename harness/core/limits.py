"""Limits in one place (the CLI, the runner and the worker read them from here): the time limits of a
launch, and the disk space a run needs at the least."""

import shutil
from pathlib import Path

LAUNCH_TIMEOUT_S: float = 900.0       # a launch still running after this is killed (ERROR cell)
COLLECTIVE_TIMEOUT_S: float = 120.0   # a collective waiting this long fails: a hung peer ends the launch

# The largest values the command line and the engine templates accept (a larger one is exit 2 naming the
# maximum, never an overflow inside a run): a time limit of a week, a sequence slot of 16 Mi tokens, a KV budget
# of 16 TiB per rank.
MAX_TIMEOUT_S: float = 7 * 24 * 3600.0
MAX_SEQ_LEN: int = 1 << 24
MAX_KV_BUDGET_MIB: int = 1 << 24
# a seed fits a signed 64-bit integer: torch's generators, the history store's INTEGER column and the engines'
# per-request seed fields all take it
MAX_SEED: int = (1 << 63) - 1

# Disk space, a lower bound (a run given less surely fails): a run folder of the tiny shipped models
# (6 prompts, 256-token vocabularies) holds about 940 KiB, mostly tensors.safetensors; larger models
# need more. `harness run` refuses to start when --out has less free than this per launched cell plus
# the reports, and the runner stops the matrix when a cell fails on a disk with less than one run left.
RUN_DIR_MIN_BYTES: int = 512 * 1024
REPORTS_MIN_BYTES: int = 256 * 1024


def free_bytes(folder: Path) -> int:
    """Free bytes (for this user) on the filesystem of `folder`, or of its nearest existing parent."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free
