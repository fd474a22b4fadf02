"""Recorded reference baselines: what each reference produced, kept across builds, and the gate of a cell's
reference against it (the check reference_baseline).

Every parity check compares a cell with its own build's reference, so a bug in code the reference runs too is
invisible to them. A recorded reference is not: each later run's reference is compared with the one recorded from
an earlier build, within what rounding in the dtype explains (reference_record.RoundingBound, from first
principles; never a noise run of the build under test), and a difference FAILs as "the reference changed since
build X", localized to its case, position and layer.

File baselines/references.yaml (schema REFERENCE_SCHEMA_VERSION), one entry per reference identity:

    schema_version: 1
    baselines:
    - model: tiny-gqa                # identity (ReferenceKey): model, engine and its version, dtype, reference
      engine: embedded               #   topology (speculator included), the checkpoint's content hash
      engine_version: '1'            #   (weights_hash), the cases (prompts_hash: the teacher-forced token ids;
      dtype: float32                 #   generation_hash: max_new_tokens, top-k, speculator settings, workloads,
      topology: tp1                  #   pool and schedule of the job)
      weights_hash: 11a8a1a78efc...
      prompts_hash: 930ec89c37eb...
      generation_hash: 5be0c2d1aa40...
      record: references/3f2a9c0d51e6b7a8.safetensors   # the record (reference_record.py), content-addressed
      sha256: 3f2a9c0d51e6b7a8...    # of that file: a damaged file is an ERROR, never a verdict
      bytes: 14320                   # its size
      cases: 6
      bound: {dtype, layers, width, unit_roundoff, growth}   # the rounding bound it is compared within
      accepted: null                 # or {reason, date, replaced: {git_commit, run_id, sha256}}: an
                                     #   intentional numerics change (`harness baseline accept`)
      provenance: {harness_version, git_commit, device, date, run_id, suite, command}

Written by `harness baseline update --from RUN_DIR` (new identities; an identity whose reference changed
beyond rounding is refused there) and `harness baseline accept --from RUN_DIR --reason TEXT` (the changed
ones, with the reason), both showing the diff first, under the one store's provenance rule
(harness/baselines/baseline_store.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from safetensors import SafetensorError
from safetensors.torch import load_file, save

from harness.baselines.baseline_store import (
    BaselineSet,
    measured_by,
    provenance_of,
    read_entries,
    unrecordable,
    update_command,
    write_file,
)
from harness.baselines.reference_record import (
    Comparison,
    Record,
    RoundingBound,
    bound_of,
    compare_records,
    record_of,
)
from harness.core.errors import ConfigError, RunError
from harness.core.paths import BASELINES_DIR
from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.records.artifacts import RunArtifacts, read_run
from harness.records.contract import (
    JOB_FILE,
    MANIFEST_BACKEND,
    MANIFEST_PROMPTS_HASH,
    MANIFEST_WEIGHTS_HASH,
    Job,
)
from harness.specs.loader import check_keys, expect_int

REFERENCE_SCHEMA_VERSION = 1
REFERENCE_FILE = "references.yaml"
RECORDS_DIR = "references"
CHECK = "reference_baseline"
CHANGED = "the reference changed since build"  # the failure's class, the first words of its reason
_KEY_FIELDS: tuple[str, ...] = ("model", "engine", "engine_version", "dtype", "topology", "weights_hash",
                                "prompts_hash", "generation_hash")
_ENTRY_KEYS: tuple[str, ...] = (*_KEY_FIELDS, "record", "sha256", "bytes", "cases", "bound", "accepted",
                                "provenance")
# the job fields the reference's outputs depend on besides the weights, the token ids, the dtype and topology
_GENERATION_FIELDS: tuple[str, ...] = ("max_new_tokens", "decode_prefix_tokens", "top_k", "speculative", "workloads",
                                       "pool", "schedule", "request_schedule")


@dataclass(frozen=True)
class ReferenceKey:
    """What a reference's outputs depend on (never the build: that is what the baseline spans)."""

    model: str
    engine: str
    engine_version: str
    dtype: str
    topology: str
    weights_hash: str
    prompts_hash: str
    generation_hash: str

    @property
    def label(self) -> str:
        return (f"{self.model} / {self.engine} {self.engine_version} / {self.topology} / {self.dtype} / weights "
                f"{self.weights_hash[:12]} / prompts {self.prompts_hash[:12]} / generation "
                f"{self.generation_hash[:12]}")

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _KEY_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReferenceKey":
        return cls(**{name: str(data[name]) for name in _KEY_FIELDS})


@dataclass(frozen=True)
class ReferenceBaseline:
    """The recorded reference of one key: its record file, the bound it is compared within, how it was measured,
    and the accepted numerics change that put it there (if one did)."""

    key: ReferenceKey
    record: str
    sha256: str
    bytes: int
    cases: int
    bound: Mapping[str, Any]
    accepted: Mapping[str, Any] | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.key.label

    @property
    def sort_key(self) -> str:
        return self.key.label

    def summary(self) -> str:
        why = f", accepted: {self.accepted.get('reason')}" if self.accepted else ""
        return f"{self.cases} cases, {self.bytes} bytes ({self.record}){why}"

    def built_by(self) -> str:
        """The build it was recorded from, in words."""
        commit = str(self.provenance.get("git_commit") or "unknown")[:12]
        run = self.provenance.get("run_id")
        return f"{commit}" + (f" (run {run}, {self.provenance.get('date')})" if run else "")

    def to_dict(self) -> dict[str, Any]:
        return {**self.key.to_dict(), "record": self.record, "sha256": self.sha256, "bytes": self.bytes,
                "cases": self.cases, "bound": dict(self.bound),
                "accepted": dict(self.accepted) if self.accepted else None, "provenance": dict(self.provenance)}


@dataclass(frozen=True)
class ReferenceBaselines(BaselineSet[ReferenceBaseline]):
    """All recorded references (one index file and its record files)."""

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": REFERENCE_SCHEMA_VERSION, "baselines": [e.to_dict() for e in self.entries]}


def references_path(folder: Path = BASELINES_DIR) -> Path:
    return folder / REFERENCE_FILE


def _entry(where: str, data: Any) -> ReferenceBaseline:
    check_keys(where, data, _ENTRY_KEYS, required=(*_KEY_FIELDS, "record", "sha256", "cases", "bound"))
    bound, accepted = data["bound"], data.get("accepted")
    if not isinstance(bound, Mapping) or not all(k in bound for k in ("dtype", "layers", "width")):
        raise ConfigError(f"{where}: bound must be a mapping with dtype, layers and width, got {bound!r}")
    if accepted is not None and (not isinstance(accepted, Mapping) or not accepted.get("reason")):
        raise ConfigError(f"{where}: accepted must be null or a mapping with a reason, got {accepted!r}")
    return ReferenceBaseline(ReferenceKey.from_dict(data), str(data["record"]), str(data["sha256"]),
                             expect_int(where, "bytes", data.get("bytes", 0), minimum=0),
                             expect_int(where, "cases", data["cases"], minimum=0), dict(bound),
                             dict(accepted) if accepted else None, provenance_of(where, data))


def read_references(path: Path) -> ReferenceBaselines:
    """Parse the index; a missing file holds none."""
    if not path.is_file():
        return ReferenceBaselines()
    _, entries = read_entries(path, ("schema_version", "baselines"), REFERENCE_SCHEMA_VERSION,
                              "reference baselines", _entry)
    return ReferenceBaselines(tuple(entries))


def load_references(folder: Path = BASELINES_DIR) -> ReferenceBaselines:
    return read_references(references_path(folder))


def write_references(baselines: ReferenceBaselines, path: Path) -> None:
    """Write the index atomically (the record files are written first, by store_record)."""
    write_file(path, "# Recorded reference baselines; written by `harness baseline update --from RUN_DIR` and "
               "`harness baseline accept`\n# (edit with care). Records: harness/baselines/reference_record.py.\n",
               baselines.to_dict())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_file(record: Record) -> tuple[str, str, bytes]:
    """`record` as its content-addressed file: (path relative to the baselines folder, sha256, bytes); keys sorted,
    so one record is one byte string."""
    data = save({k: record[k].contiguous() for k in sorted(record)})
    digest = hashlib.sha256(data).hexdigest()
    return f"{RECORDS_DIR}/{digest[:16]}.safetensors", digest, data


def store_record(rel: str, data: bytes, folder: Path) -> None:
    """Write a record file (atomically; an identical one already there is kept, a damaged one replaced)."""
    path = folder / rel
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.write_bytes(data)
        tmp.replace(path)


def load_record(entry: ReferenceBaseline, folder: Path) -> Record:
    """The stored record of `entry`; RunError naming the file when it is missing or fails its checksum."""
    path = folder / entry.record
    if not path.is_file():
        raise RunError(f"recorded reference {entry.label}: its record {path} is missing")
    if _sha256(path) != entry.sha256:
        raise RunError(f"recorded reference {entry.label}: {path} fails its sha256 (damaged or edited); "
                       f"re-record it with `harness baseline update`")
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise RunError(f"recorded reference {entry.label}: {path} unreadable: {exc}") from exc


def key_of(run: RunArtifacts, model: str) -> ReferenceKey:
    """The identity of a reference run (its manifest and job.json)."""
    backend = run.manifest.get(MANIFEST_BACKEND) or {}
    job_path = run.path / JOB_FILE
    if not job_path.is_file():
        raise RunError(f"{run.path}: no {JOB_FILE} (the settings its generation depends on)")
    try:
        job = Job.load(job_path).to_dict()
    except ConfigError as exc:
        raise RunError(f"{job_path}: {exc}") from exc
    generation = json.dumps({name: job.get(name) for name in _GENERATION_FIELDS}, sort_keys=True, default=str)
    topology = run.manifest.get("topology") or {}
    return ReferenceKey(model=model, engine=str(backend.get("name", "embedded")),
                        engine_version=str(backend.get("version", "")),
                        dtype=str(run.manifest.get("dtype")),
                        topology=str(topology.get("name") if isinstance(topology, Mapping) else topology),
                        weights_hash=str(run.manifest.get(MANIFEST_WEIGHTS_HASH)),
                        prompts_hash=str(run.manifest.get(MANIFEST_PROMPTS_HASH)),
                        generation_hash=hashlib.sha256(generation.encode()).hexdigest())


def bound_of_run(run: RunArtifacts) -> RoundingBound:
    model = run.manifest.get("model") or {}
    return bound_of(model if isinstance(model, Mapping) else {}, str(run.manifest.get("dtype")), run)


def compare_with(entry: ReferenceBaseline, folder: Path, run: RunArtifacts) -> tuple[Comparison, RoundingBound]:
    """The run's record against the recorded one of its key, within the recorded bound."""
    stored = load_record(entry, folder)
    bound = RoundingBound(str(entry.bound["dtype"]), int(entry.bound["layers"]), int(entry.bound["width"]))
    return compare_records(stored, record_of(run), bound, [c.index for c in run.cases]), bound


def accept_command(run_dir: str, suite: str) -> str:
    return f"harness baseline accept --from {run_dir} --suite {suite} --reason TEXT"


def gate_reference(baselines: ReferenceBaselines, folder: Path, ref: RunArtifacts, model: str, run_dir: str,
                   suite: str) -> CheckResult:
    """A cell's reference against the recorded one of its key: FAIL (CHANGED) at the first difference beyond
    rounding, naming the build it was recorded from, where it is and how to accept an intended change; PASS
    within rounding (naming an accepted change the recording carries); SKIP naming the command that records one
    when the key has none or the reference run has no job.json to identify it by; ERROR when the recording is
    damaged."""
    try:
        key = key_of(ref, model)
    except RunError as exc:  # a stored run without its job: nothing to identify it by, so nothing to compare
        return CheckResult(CHECK, Verdict.SKIP, f"the reference cannot be identified: {exc}")
    # the reasons name the commands with RUN_DIR (a verdict's words do not depend on where the run was written:
    # runs of one build into other folders give the same reasons); the metrics hold them for this run's folder
    metrics: dict[str, Any] = {"key": key.to_dict(), "update_command": update_command(run_dir, suite),
                               "accept_command": accept_command(run_dir, suite)}
    entry = baselines.get(key)
    if entry is None:
        return CheckResult(CHECK, Verdict.SKIP, f"no recorded reference for {key.label}; record one from a clean "
                                                f"run with `{update_command('RUN_DIR', suite)}` (RUN_DIR: "
                                                f"that run's --out)", metrics)
    try:
        found, bound = compare_with(entry, folder, ref)
    except RunError as exc:
        return CheckResult(CHECK, Verdict.ERROR, str(exc), metrics)
    metrics.update({**found.to_dict(), "bound": bound.to_dict(), "recorded_by": entry.built_by(),
                    "baseline_provenance": dict(entry.provenance),
                    "accepted_change": dict(entry.accepted) if entry.accepted else None})
    if found.difference is not None:
        return CheckResult(CHECK, Verdict.FAIL,
                           f"{CHANGED} {entry.built_by()}: {found.difference.text()} (bound: {bound.describe()}); "
                           f"a fault in code the reference runs too, or an intended numerics change: accept that "
                           f"with `{accept_command('RUN_DIR', suite)}` (RUN_DIR: this run's --out)", metrics)
    accepted = (f"; carries an accepted numerics change ({entry.accepted.get('date')}: "
                f"{entry.accepted.get('reason')})" if entry.accepted else "")
    ties = f", {found.near_ties} divergence(s) at recorded near ties" if found.near_ties else ""
    return CheckResult(CHECK, Verdict.PASS,
                       f"the reference matches its recording from build {entry.built_by()}: {found.compared} "
                       f"values within rounding (largest |diff| {found.max_error:.1e}, bound there "
                       f"{found.bound_at_max:.1e}){ties}{accepted}", metrics)


@dataclass(frozen=True)
class Candidate:
    """A run's reference under its key, ready to record: its entry (record file written) and comparison with
    the stored one of its key (None when the key is new)."""

    entry: ReferenceBaseline
    changed: Comparison | None
    cell: str
    data: bytes  # the record file's bytes (written with the index)


def candidates(cells: list[CellResult], provenance: Mapping[str, Any], run_id: str, created: str,
               folder: Path) -> tuple[list[Candidate], list[str]]:
    """Each reference of the run's recordable cells once per key (its record stored content-addressed in
    `folder`), compared with the stored entry of its key; and why other cells give none. Two cells giving
    different records for one key is an error."""
    stored = load_references(folder)
    found: dict[ReferenceKey, Candidate] = {}
    skipped: list[str] = []
    for cell in cells:
        label = f"{cell.model} / {cell.topology} (seed {cell.seed})"
        why = unrecordable(cell) or (None if cell.reference_dir else "no reference run")
        if why is None and not (Path(cell.reference_dir) / JOB_FILE).is_file():
            why = f"its reference run {cell.reference_dir} is gone (cache pruned?); run the suite again"
        if why is not None:
            skipped.append(f"skip reference of {label}: {why}")
            continue
        ref = read_run(Path(cell.reference_dir))
        if not ref.ok:
            skipped.append(f"skip reference of {label}: the reference run failed")
            continue
        key = key_of(ref, cell.model)
        rel, digest, data = record_file(record_of(ref))
        old = found.get(key)
        if old is not None:
            if old.entry.sha256 != digest:
                raise ConfigError(f"two cells of the run give different references for {key.label} ({old.cell}, "
                                  f"{label}); record from one run")
            continue
        bound = bound_of_run(ref)
        prov = measured_by(provenance, cell, run_id, created, suite=cell.suite)
        entry = ReferenceBaseline(key, rel, digest, len(data), len(ref.cases), bound.to_dict(), None, prov)
        current = stored.get(key)
        changed = None
        if current is not None and current.sha256 != digest:
            try:
                changed, _ = compare_with(current, folder, ref)
            except RunError as exc:  # a damaged recording is replaced
                skipped.append(f"note: {exc}")
        found[key] = Candidate(entry, changed, label, data)
    return list(found.values()), skipped


def updates(found: list[Candidate], folder: Path, reason: str | None) -> tuple[list[Candidate], list[str]]:
    """The entries `harness baseline update` (reason None) or `accept` (the reason) writes, and what it refuses
    or keeps, in words. Update: new keys and bit-identical ones (provenance); a recording the run matches within
    rounding is kept as recorded; one it differs from is refused (accept takes it). Accept: only the changed
    ones, each with the reason and what it replaced."""
    stored = load_references(folder)
    out: list[Candidate] = []
    notes: list[str] = []
    for cand in found:
        current = stored.get(cand.entry.key)
        differs = cand.changed is not None and cand.changed.difference is not None
        if reason is not None:
            if differs and current is not None:
                out.append(replace(cand, entry=replace(cand.entry, accepted={
                    "reason": reason, "date": cand.entry.provenance.get("date"),
                    "replaced": {"git_commit": current.provenance.get("git_commit"),
                                 "run_id": current.provenance.get("run_id"), "sha256": current.sha256}})))
            continue
        if current is None or current.sha256 == cand.entry.sha256:
            out.append(replace(cand, entry=replace(cand.entry, accepted=current.accepted)) if current is not None
                       else cand)
        elif differs:
            assert cand.changed is not None and cand.changed.difference is not None
            notes.append(f"refused {cand.entry.label}: {CHANGED} {current.built_by()}: "
                         f"{cand.changed.difference.text()}; if intended: `harness baseline accept` with a reason")
        else:
            notes.append(f"kept {cand.entry.label}: the run's reference is within rounding of the recorded one")
    return out, notes


def write_candidates(written: list[Candidate], baselines: ReferenceBaselines, path: Path) -> None:
    """Write the record files of `written`, then the index with their entries merged in."""
    for cand in written:
        store_record(cand.entry.record, cand.data, path.parent)
    write_references(baselines.merged([c.entry for c in written]), path)


def recheck(cell: CellResult, folder: Path, run_dir: str) -> CellResult:
    """`cell` with its reference compared with the recorded references in `folder` now (`harness signoff`): where
    its run had none to compare with (reference_baseline SKIP or absent) and its reference run is still on disk.
    Otherwise the cell as its run judged it."""
    current = next((c for c in cell.checks if c.name == CHECK), None)
    if (current is not None and current.verdict is not Verdict.SKIP) or not cell.reference_dir \
            or not (Path(cell.reference_dir) / JOB_FILE).is_file():
        return cell
    ref = read_run(Path(cell.reference_dir))
    if not ref.ok:
        return cell
    found = gate_reference(load_references(folder), folder, ref, cell.model, run_dir, cell.suite)
    if found.verdict is Verdict.SKIP and current is not None:
        return cell
    checks = tuple(found if c.name == CHECK else c for c in cell.checks) if current is not None \
        else (*cell.checks, found)
    return replace(cell, checks=checks)
