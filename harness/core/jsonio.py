"""JSON files: atomic writes, and reads whose errors name the file (no heavy imports here)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError, RunError

_UMASK = os.umask(0)
os.umask(_UMASK)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write a file atomically: into a temporary file in the same folder, flushed to disk (fsync), then
    renamed over `path`. A crash or a full disk never leaves half a file: `path` is either the complete
    new file or as it was, and the temporary file is removed when the write fails."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # the mode an ordinary write would give (mkstemp makes 0600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a UTF-8 text file atomically (write_bytes_atomic)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    """Write `data` as JSON atomically; `indent=None` for files of megabytes that programs read (json's C encoder
    writes only those: a 140-cell results.json of 20 MB took 0.94 s indented, 0.15 s compact)."""
    write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=False, default=str))


def read_json(path: Path, error: type[HarnessError] = RunError) -> Any:
    """Parse `path`; a missing, corrupt or non-UTF-8 file raises `error` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{path} is not a text JSON file (byte {exc.start} is not UTF-8)") from None
    except FileNotFoundError as exc:
        raise error(f"missing {path}") from exc
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise error(f"{path}: invalid JSON: {exc}") from exc
