"""Helpers every backend shares: stamping the manifest with who produced a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.contract import MANIFEST_BACKEND, MANIFEST_FILE, Backend
from harness.errors import RunError
from harness.jsonio import read_json, write_json


def backend_record(backend: Backend) -> dict[str, Any]:
    """The manifest's `backend` entry: name, version and capabilities, and its build label when it has one."""
    record = {"name": backend.name, "version": backend.version(), "capabilities": backend.capabilities().to_dict()}
    build = engine_build(backend)
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


def engine_env(backend: Backend) -> dict[str, str]:
    """The engine's own environment variables the backend runs with (an HTTP template's engine_env), else {}."""
    values = getattr(backend, "engine_env", None)
    return dict(values()) if callable(values) else {}


def engine_build(backend: Backend) -> str:
    """The build label a backend runs ('' when it has none: harness/backends/build.py)."""
    build = getattr(backend, "engine_build", None)
    return str(build() or "") if callable(build) else ""


def engine_fault(backend: Backend) -> str | None:
    """"VAR=VALUE" of the engine-side fault variables set for the backend (template engine_faults), else None."""
    fault = getattr(backend, "engine_fault", None)
    return fault() if callable(fault) else None
