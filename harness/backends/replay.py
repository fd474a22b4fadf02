"""The replay backend: serves stored run directories instead of running an engine.

`--engine replay:DIR` answers each job with the run directory under DIR (searched recursively, e.g.
a report's runs/ folder or a reference cache) whose job.json matches the job, or, for runs written
by another tool without a job.json, whose manifest names the same model, topology, fault, seed and
dtype. The run's files are copied into the job's run directory. It is the worked example of a
backend (README "Adding an engine") and a test fixture: tamper with a stored run, replay it, and
see which check catches it.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

from harness import __version__
from harness.core.errors import ConfigError, RunError
from harness.core.jsonio import read_json, write_json
from harness.records import contract as c
from harness.records.contract import Backend, Capabilities, Job, LaunchResult
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

VOLATILE_JOB_KEYS: tuple[str, ...] = ("out_dir", "git_commit", "collective_timeout_s", "device")


def _job_content(job: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in job.items() if k not in VOLATILE_JOB_KEYS}


class ReplayBackend(Backend):
    """Stored run directories under one folder, matched to jobs."""

    name = "replay"

    def __init__(self, option: str | None = None) -> None:
        if not option:
            raise ConfigError("engine 'replay' needs a folder of stored runs: --engine replay:DIR")
        self.root = Path(option)
        if not self.root.is_dir():
            raise ConfigError(f"engine replay: {self.root} is not a folder")
        self._runs = sorted(p.parent for p in self.root.rglob(c.MANIFEST_FILE))

    def version(self) -> str:
        return __version__

    def _manifest(self, run: Path) -> dict[str, Any]:
        try:
            manifest = read_json(run / c.MANIFEST_FILE)
        except RunError:
            return {}
        return manifest if isinstance(manifest, dict) else {}

    def capabilities(self) -> Capabilities:
        """What every stored run records (all of the embedded engine's artifacts when none records any)."""

        recorded = [c.recorded_capabilities(self._manifest(run)) for run in self._runs]
        found = [caps for caps in recorded if caps is not None]
        if not found:
            return Capabilities(provides=c.FULL_ARTIFACTS)
        provides = frozenset.intersection(*(caps.provides for caps in found))
        return Capabilities(provides=provides, top_k=min(caps.top_k for caps in found))

    def find(self, job: Job) -> Path | None:
        """The stored run answering `job`, or None."""
        want = _job_content(job.to_dict())
        by_manifest = None
        for run in self._runs:
            manifest = self._manifest(run)
            if manifest.get("status") != "ok":
                continue
            if (run / c.JOB_FILE).is_file():
                try:  # parsed and written again: a job.json of an earlier harness compares as the job it means
                    if _job_content(Job.load(run / c.JOB_FILE).to_dict()) == want:
                        return run
                except (RunError, ConfigError):
                    pass
                continue
            topo, model = manifest.get("topology") or {}, manifest.get("model") or {}
            if (topo.get("name"), model.get("name"), manifest.get("fault"), manifest.get("seed"),
                    manifest.get("dtype")) == (job.topology.name, job.model.name, job.fault, job.seed,
                                               job.dtype or job.model.dtype):
                by_manifest = by_manifest or run
        return by_manifest

    def identity(self, job: Job) -> dict[str, Any]:
        run = self.find(job)
        digest = hashlib.sha256((run / c.MANIFEST_FILE).read_bytes()).hexdigest() if run else None
        return {"engine": self.name, "root": str(self.root.resolve()), "run": str(run), "manifest": digest}

    def skip_reason(self, model: ModelSpec, topology: Topology) -> str | None:
        return None

    def noise_strategy(self) -> str:
        return c.NOISE_PRECISION_TWIN  # a stored float64 twin is served like any other run

    def run(self, job: Job, timeout_s: float) -> LaunchResult:
        start = time.time()
        out = Path(job.out_dir)
        run = self.find(job)
        if run is None:
            error = (f"replay: no stored run under {self.root} matches {job.model.name} "
                     f"{job.topology.name} fault={job.fault} seed={job.seed} dtype={job.dtype}")
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / c.MANIFEST_FILE, {"schema_version": 1, "status": "error", "error": error,
                                               "topology": job.topology.to_dict(), "fault": job.fault,
                                               "seed": job.seed})
            return LaunchResult(False, None, time.time() - start, error, {})
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(run, out)
        manifest = read_json(out / c.MANIFEST_FILE)
        write_json(out / c.MANIFEST_FILE, {**manifest, "replayed_from": str(run)})
        return LaunchResult(True, 0, time.time() - start, "", {})
