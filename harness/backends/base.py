"""Helpers every backend shares: stamping the manifest with who produced a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.errors import RunError
from harness.core.jsonio import read_json, write_json
from harness.records.contract import MANIFEST_BACKEND, MANIFEST_FILE, Backend


def backend_record(backend: Backend) -> dict[str, Any]:
    """The manifest's `backend` entry: name, version and capabilities, and its build label when it has one."""
    record = {"name": backend.name, "version": backend.version(), "capabilities": backend.capabilities().to_dict()}
    build = backend.engine_build()
    return {**record, "build": build} if build else record


def stamp_manifest(run_dir: Path, backend: Backend) -> None:
    """Record the backend in run_dir's manifest.json (left alone when there is none to stamp)."""
    path = run_dir / MANIFEST_FILE
    try:
        manifest = read_json(path)
    except RunError:
        return
    if isinstance(manifest, dict):
        write_json(path, {**manifest, MANIFEST_BACKEND: backend_record(backend)})
