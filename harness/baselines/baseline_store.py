"""The one store of stored baselines: every metric's file (GSM8K scores in baselines/<suite>.yaml,
speculative acceptance in baselines/acceptance.yaml) is a versioned YAML list of entries read, merged,
diffed and written here, under one provenance rule.

The provenance rule, the same for every metric:
- An entry is identified by its key (what the measurement depends on: GSM8K's model, task variant,
  topology and n; acceptance's AcceptanceKey), never by its provenance. A file holds one entry per key.
- Provenance (who measured the value, on what, when, with which command: `measured_by`) is stored with
  the value and shown, never part of the key, and never changes a gate's verdict: a gate compares the
  measured value with the stored one and records the entry's provenance in its metrics
  (`baseline_provenance`).
- `harness baseline update` shows every field of an entry that would change, provenance included
  ("provenance.git_commit: 'a' -> 'b'"), and a provenance change alone is a change it writes: the file
  then names the run that measured the value last.

A metric's entry type gives its key, label, sort order and one-line summary (StoredEntry); its file type
is a BaselineSet of those entries (harness/baselines/baseline.py, harness/baselines/acceptance_baseline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, Mapping, Protocol, TypeVar

import yaml

from harness.core.errors import ConfigError
from harness.core.jsonio import write_text_atomic
from harness.core.verdict import CellResult, Verdict
from harness.specs.loader import read_versioned_list


class StoredEntry(Protocol):
    """One stored baseline of some metric."""

    @property
    def provenance(self) -> Mapping[str, Any]: ...

    @property
    def key(self) -> Hashable:
        """Its identity: what the measurement depends on (never its provenance)."""
        ...

    @property
    def label(self) -> str:
        """The key in words (diffs, errors, gate reasons)."""
        ...

    @property
    def sort_key(self) -> Any:
        """Where it goes in the file."""
        ...

    def summary(self) -> str:
        """Its value in one line (a new entry's diff line)."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """The entry as its file stores it: key fields, value fields, `provenance`."""
        ...


E = TypeVar("E", bound=StoredEntry)
S = TypeVar("S", bound="BaselineSet[Any]")


@dataclass(frozen=True)
class BaselineSet(Generic[E]):
    """The entries of one baselines file, at most one per key."""

    entries: tuple[E, ...] = ()

    def get(self, key: Hashable) -> E | None:
        return next((e for e in self.entries if e.key == key), None)

    def merged(self: S, updates: list[E]) -> S:
        """These baselines with `updates` replacing entries of the same key, in file order."""
        by_key = {e.key: e for e in self.entries}
        by_key.update({e.key: e for e in updates})
        return replace(self, entries=tuple(sorted(by_key.values(), key=lambda e: e.sort_key)))

    def diff(self, updates: list[E]) -> tuple[list[str], int]:
        """Human-readable diff of applying `updates` (every changed field, provenance included: the
        provenance rule) and the number of entries that change."""
        lines: list[str] = []
        changed = 0
        for new in sorted(updates, key=lambda e: e.sort_key):
            cur = self.get(new.key)
            if cur is None:
                changed += 1
                lines.append(f"+ {new.label}: {new.summary()} [new]")
                continue
            fields = changed_fields(cur.to_dict(), new.to_dict())
            if not fields:
                lines.append(f"= {new.label}: unchanged")
                continue
            changed += 1
            lines.append(f"~ {new.label}:")
            lines += [f"    {name}: {a!r} -> {b!r}" for name, a, b in fields]
        return lines, changed


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, old value, new value) of every field that differs, nested mappings field by field."""
    out: list[tuple[str, Any, Any]] = []
    for name in list(old) + [k for k in new if k not in old]:
        a, b = old.get(name), new.get(name)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += changed_fields(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append((f"{prefix}{name}", a, b))
    return out


def read_entries(path: Path, top_keys: tuple[str, ...], version: int, what: str,
                 parse: Callable[[str, Any], E]) -> tuple[dict[str, Any], list[E]]:
    """A baselines file's top level and its entries (each parsed by `parse(where, data)`); two entries of
    one key are an error naming them. The file must exist."""
    data, raw = read_versioned_list(path, top_keys, version)
    entries = [parse(f"{path} baselines[{i}]", e) for i, e in enumerate(raw)]
    keys = [e.key for e in entries]
    dupes = sorted({e.label for e in entries if keys.count(e.key) > 1})
    if dupes:
        raise ConfigError(f"{path}: duplicate {what} for {', '.join(dupes)}")
    return data, entries


def provenance_of(where: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """An entry's stored `provenance` mapping ({} when absent)."""
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, Mapping):
        raise ConfigError(f"{where}: provenance must be a mapping, got {provenance!r}")
    return dict(provenance)


def write_file(path: Path, header: str, data: Mapping[str, Any]) -> None:
    """Write a baselines file atomically (a crash never leaves half a file), `header` comment lines first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, header + yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True))


def measured_by(provenance: Mapping[str, Any], cell: CellResult, run_id: str, created: str,
                **extra: Any) -> dict[str, Any]:
    """The provenance of a baseline recorded from `cell` of a run (its results.json provenance, id and
    creation date): the same fields for every metric, then the metric's own `extra` ones."""
    return {"harness_version": provenance.get("harness_version"), "git_commit": provenance.get("git_commit"),
            "device": provenance.get("device"), **extra, "date": created, "run_id": run_id,
            "command": cell.command}


def unrecordable(cell: CellResult) -> str | None:
    """Why no metric of `cell` may become a baseline (a positive control, a broken run), else None."""
    if cell.fault:
        return f"fault {cell.fault!r} injected: a positive control is not a baseline"
    if not cell.clean_exit or cell.status is Verdict.ERROR:
        return "the run broke (ERROR)"
    return None


def update_command(run_dir: str, suite: str) -> str:
    """The command that records a run's baselines (named by a gate that finds none)."""
    return f"harness baseline update --from {run_dir} --suite {suite}"
