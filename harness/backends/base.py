"""Helpers every backend shares: stamping the manifest with who produced a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.errors import RunError
from harness.core.jsonio import read_json, write_json
from harness.records.contract import MANIFEST_BACKEND, MANIFEST_FILE, Backend, Capabilities


def backend_record(backend: Backend) -> dict[str, Any]:
    """The manifest's `backend` entry: name, version and capabilities, and its build label when it has one."""
    record = {"name": backend.name, "version": backend.version(), "capabilities": backend.capabilities().to_dict()}
    build = backend.engine_build()
    return {**record, "build": build} if build else record


def stamp_manifest(run_dir: Path, backend: Backend, provided: Capabilities | None = None,
                   keep_provided: bool = False) -> None:
    """Record the backend in run_dir's manifest.json (left alone when there is none to stamp). `provided`: what this
    run provided when it is less than the backend's capabilities (an HTTP run on a server without a log or probe);
    `keep_provided`: keep the capabilities the run already recorded (a wrapper naming itself, build.py)."""
    path = run_dir / MANIFEST_FILE
    try:
        manifest = read_json(path)
    except RunError:
        return
    if not isinstance(manifest, dict):
        return
    record = backend_record(backend)
    earlier = manifest.get(MANIFEST_BACKEND)
    if provided is not None:
        record["capabilities"] = provided.to_dict()
    elif keep_provided and isinstance(earlier, dict) and isinstance(earlier.get("capabilities"), dict):
        record["capabilities"] = earlier["capabilities"]
    write_json(path, {**manifest, MANIFEST_BACKEND: record})
