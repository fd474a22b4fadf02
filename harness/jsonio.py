"""JSON files: atomic writes, and reads whose errors name the file (no heavy imports here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.errors import HarnessError, RunError


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file atomically (a crash never leaves half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str))


def read_json(path: Path, error: type[HarnessError] = RunError) -> Any:
    """Parse `path`; a missing or corrupt file raises `error` naming it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise error(f"missing {path}") from exc
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise error(f"{path}: invalid JSON: {exc}") from exc
