"""The build of an engine, beside its version: an engine team's own build (a fork, a patched wheel, a local
checkout) often keeps the version string of the release it started from, so two builds would share one
reference-cache key and one history line. A build label tells them apart: `harness run --engine-build LABEL`,
or the one an engine template's `build_argv` prints (its own version command, e.g. the checkout's commit).

The label is part of the backend's identity (so of the reference-cache key), recorded in each run's manifest
(backend.build), each cell (engine_build) and the provenance, shown in the report and repeated by the
reproduce command (--engine-build).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.backends.base import stamp_manifest
from harness.core.errors import ConfigError
from harness.records.contract import Backend, Capabilities, Job, LaunchResult

MAX_LABEL = 200


def check_label(label: str, where: str = "--engine-build") -> str:
    """A build label: one line of printable text (it lands in file names' neighbours, commands, reports)."""
    text = label.strip()
    if not text or len(text) > MAX_LABEL or not text.isprintable():
        raise ConfigError(f"{where}={label!r} is not a build label: give one line of printable text, 1 to "
                          f"{MAX_LABEL} characters (e.g. a commit of the engine's checkout)")
    return text


class LabelledBackend(Backend):
    """`backend` run as the build `label`: the same runs, keyed, recorded and reported with the label;
    every other part of the protocol is the wrapped backend's."""

    def __init__(self, backend: Backend, label: str) -> None:
        self.inner = backend
        self.label = label
        self.name = backend.name

    def engine_build(self) -> str:
        return self.label

    def engine_env(self) -> dict[str, str]:
        return self.inner.engine_env()

    def engine_fault(self) -> str | None:
        return self.inner.engine_fault()

    def reseeds_weights(self) -> bool:
        return self.inner.reseeds_weights()

    def as_reference(self) -> Backend:
        return LabelledBackend(self.inner.as_reference(), self.label)

    def independent_runs(self) -> bool:
        return self.inner.independent_runs()

    def version(self) -> str:
        return self.inner.version()

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def identity(self, job: Job) -> dict[str, Any]:
        return {**self.inner.identity(job), "engine_build": self.label}

    def skip_reason(self, model: Any, topology: Any) -> str | None:
        return self.inner.skip_reason(model, topology)

    def machine_backend(self, model: Any) -> dict[str, Any] | None:
        return self.inner.machine_backend(model)

    def workload_skip(self, topology: Any, workload: Any) -> str | None:
        return self.inner.workload_skip(topology, workload)

    def noise_strategy(self) -> str:
        return self.inner.noise_strategy()

    def run(self, job: Job, timeout_s: float) -> LaunchResult:
        result = self.inner.run(job, timeout_s)
        stamp_manifest(Path(job.out_dir), self, keep_provided=True)  # its backend entry names the build
        return result


def with_build(backend: Backend, label: str | None) -> Backend:
    """`backend` labelled as build `label` (None: as it is, with whatever build it names itself)."""
    return backend if not label else LabelledBackend(backend, check_label(label))
