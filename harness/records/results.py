"""results.json: the machine-readable result of a run (or of a merge of runs).

Schema, version RESULTS_SCHEMA_VERSION = 1 (a reader refuses any other version):

    {
      "schema_version": 1,
      "run_id": "20250101-120000-dcp",          # the reports/<run-id>/ folder name
      "created": "2025-01-01T12:00:00+00:00",   # UTC, when this file was written
      "provenance": {                           # how the numbers were produced
        "harness_version": "0.1.0", "git_commit": "abc123...", "torch_version": "2.x",
        "python": "3.11.7", "device": "cpu", "dtypes": ["float32"], "seeds": [0],
        "command": "harness run --suite dcp --topo tp4dcp4", "hostname": "ci-7",  # shell-quoted (shlex)
        "sources": [...],                       # only after `harness report A B`: each input's
                                                #   {dir, run_id, provenance}
        "interrupted": {"signal": "SIGTERM" | "reason": "no space left on device",  # only for a run stopped
                        "cells_finished": 4, "cells_planned": 6}  # early; the cells it never reached are
      },                                        #   listed, each with the one check "not_run" (ERROR)
      "summary": {"cells": 5, "pass": 2, "warn": 0, "fail": 1, "error": 1, "skip": 1,
                  "silent_corruption": 1,       # cells counted by their status, and failing cells by class:
                  "output": 1, "performance": 0, "infrastructure": 1},
      "cells": [                                # one per (suite, model, topology, fault, seed, workload)
        {
          "suite": "dcp", "model": "tiny-gqa", "topology": "tp4dcp4",
          "fault": "dcp-tp-kv-layout" | null, "seed": 0,
          "condition": false,                   # fault is a load condition a correct engine absorbs (pd-store-*,
                                                #   pd-load-*): no positive control, judged as a build cell
          "workload": "prompts",                # what the cell sent (harness list workloads)
          "status": "PASS" | "WARN" | "FAIL" | "ERROR" | "SKIP",   # the worst check verdict
          "silent_corruption": true,            # output corruption while every process exited cleanly
          "failure_class": "output" | "performance" | "infrastructure" | null,  # what the failure means:
                                                #   outputs wrong, only a speed figure (draft acceptance)
                                                #   regressed, or the run could not complete (ERROR)
          "clean_exit": true,
          "localization": {"layer": 0, "heads": [4, 5], "ranks": [1, 3], "kv_heads": [1],
                           "summary": "layer 0 attention: ..."} | null,
          "checks": [{"name": "logits", "verdict": "FAIL", "reason": "one line",
                      "metrics": {"max_kl": 3.2, ...},
                      "performance_only": false}],  # a check of speed, not of outputs
          "command": "harness run ...",         # reproduces this cell alone
          "run_dir": "runs/tiny-gqa/tp4dcp4/...",  # relative to this file's folder (absolute once read:
          "reference_dir": "../cache/runs/...",     #   read_results), so a moved results folder still finds
          "wall_s": 12.3,                           #   its runs
          "error_log": "",                      # log tail of a broken run (ERROR cells)
          "details": {...}                      # drill-down data for the HTML report; its keys
        }                                       #   are described in harness/report/details.py
      ]
    }

Status, failure_class and silent_corruption are derived from the checks and clean_exit on reading; the file
stores them so that other tools need not recompute them. Non-finite floats, where a check or
detail holds one, are written as Python's json writes them (NaN, Infinity, -Infinity).
"""

from __future__ import annotations

import os
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError, RunError
from harness.core.jsonio import read_json, write_json
from harness.core.limits import MAX_SEED
from harness.core.verdict import CellResult, ExitCode, FailureClass, Verdict

RESULTS_SCHEMA_VERSION = 1
RESULTS_FILE = "results.json"


class ResultsError(ConfigError):
    """A missing, corrupt or wrong-version results.json (the CLI exits 2 with this one line)."""


def summary_counts(cells: list[CellResult]) -> dict[str, int]:
    """Cells counted by status, how many are silent corruption, and the failing cells by failure class."""
    by_status = Counter(c.status for c in cells)
    counts = {"cells": len(cells)}
    counts.update({v.value.lower(): by_status.get(v, 0) for v in Verdict})
    counts["silent_corruption"] = sum(1 for c in cells if c.silent_corruption)
    by_class = Counter(c.failure_class for c in cells)
    counts.update({f.value: by_class.get(f, 0) for f in FailureClass})
    return counts


def exit_code(cells: list[CellResult]) -> int:
    """0 when every cell passes, warns or is skipped; 1 on any FAIL; 3 on any ERROR and no FAIL. Of a merge of
    build cells and positive controls (cells run with a --fault), the build cells' code, as the headline gives the
    build's verdict (a control's FAIL is its fault flagged, no failure of the build)."""
    judged = [c for c in cells if not c.control] or cells
    statuses = {c.status for c in judged}
    if Verdict.FAIL in statuses:
        return ExitCode.FAIL
    if Verdict.ERROR in statuses:
        return ExitCode.ERROR
    return ExitCode.OK


PATH_KEYS: tuple[str, ...] = ("run_dir", "reference_dir")  # cell paths, stored relative to the results folder


def _relative(path: str, base: Path) -> str:
    return os.path.relpath(path, base.absolute()) if path and os.path.isabs(path) else path


def _absolute(path: str, base: Path) -> str:
    return os.path.normpath(base.absolute() / path) if path and not os.path.isabs(path) else path


def _absolute_paths(cell: Any, base: Path) -> Any:
    """A stored cell with its relative run / reference folders made absolute against `base` (the file's folder)."""
    if not isinstance(cell, dict):
        return cell
    return {**cell, **{k: _absolute(cell[k], base) for k in PATH_KEYS if isinstance(cell.get(k), str)}}


def results_document(cells: list[CellResult], provenance: dict[str, Any], run_id: str,
                     base: Path | None = None) -> dict[str, Any]:
    """The results.json document (see the module docstring); with `base` (its folder) the cells' run and
    reference folders are written relative to it."""
    dicts = [c.to_dict() for c in cells]
    if base is not None:
        dicts = [{**d, **{k: _relative(d[k], base) for k in PATH_KEYS if isinstance(d.get(k), str)}} for d in dicts]
    return {"schema_version": RESULTS_SCHEMA_VERSION, "run_id": run_id,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "provenance": provenance, "summary": summary_counts(cells), "cells": dicts}


def write_results(out_dir: Path, cells: list[CellResult], provenance: dict[str, Any], run_id: str) -> Path:
    """Write out_dir/results.json atomically and return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    write_json(path, results_document(cells, provenance, run_id, out_dir), indent=None)
    return path


def read_results(run_dir: Path) -> tuple[list[CellResult], dict[str, Any], str]:
    """Read run_dir/results.json (or the file itself when given one): (cells, provenance, run_id)."""
    path = run_dir if run_dir.is_file() else run_dir / RESULTS_FILE
    try:
        doc = read_json(path)
    except RunError as exc:
        raise ResultsError(str(exc)) from exc
    if not isinstance(doc, dict):
        raise ResultsError(f"corrupt {path}: the top level is not a JSON object")
    version = doc.get("schema_version")
    if version != RESULTS_SCHEMA_VERSION:
        raise ResultsError(f"{path} has schema_version {version!r}; this harness reads "
                           f"schema_version {RESULTS_SCHEMA_VERSION}")
    raw_cells = doc.get("cells")
    if not isinstance(raw_cells, list):
        raise ResultsError(f"corrupt {path}: 'cells' is not a list")
    cells = [_cell_from_dict(path, i, _absolute_paths(c, path.parent)) for i, c in enumerate(raw_cells)]
    provenance = doc.get("provenance")
    return cells, dict(provenance) if isinstance(provenance, dict) else {}, str(doc.get("run_id", path.parent.name))


def results_cells(folder: Path) -> list[dict[str, Any]]:
    """The cells of folder/results.json (or of the file itself) as stored, their run and reference folders made
    absolute (for a tool that reads the JSON without CellResult)."""
    path = folder if folder.is_file() else folder / RESULTS_FILE
    return [_absolute_paths(c, path.parent) for c in read_json(path).get("cells") or []]


# the JSON types of a stored cell's fields (required ones first): a value of another type (a null model, a string
# seed, a list for details) is a ResultsError naming the cell and the field, never a crash in a reader after it
_STR, _NUM = (str,), (int, float)
CELL_TYPES: dict[str, tuple[type, ...]] = {
    "suite": _STR, "model": _STR, "topology": _STR, "checks": (list,), "fault": (str, type(None)), "seed": (int,),
    "clean_exit": (bool,), "localization": (dict, type(None)), "command": _STR, "run_dir": _STR,
    "reference_dir": _STR, "wall_s": _NUM, "error_log": _STR, "details": (dict, type(None)), "engine": _STR,
    "reference_engine": _STR, "engine_env": (dict, type(None)), "engine_build": (str, type(None)), "workload": _STR,
    "condition": (bool,)}
CELL_REQUIRED: tuple[str, ...] = ("suite", "model", "topology", "checks")
CHECK_TYPES: dict[str, tuple[type, ...]] = {"name": _STR, "verdict": _STR, "reason": _STR,
                                            "metrics": (dict, type(None)), "performance_only": (bool, type(None))}
_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
               dict: "an object", type(None): "null"}


def _check_fields(where: str, data: Any, types: dict[str, tuple[type, ...]], required: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise ResultsError(f"{where} is not a JSON object (got {type(data).__name__})")
    for key in required:
        if key not in data:
            raise ResultsError(f"{where} lacks the key {key!r}")
    for key, allowed in types.items():
        if key not in data:
            continue
        value = data[key]
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            want = " or ".join(dict.fromkeys(_JSON_NAMES[t] for t in allowed))
            raise ResultsError(f"{where}: {key} must be {want}, got {str(json_repr(value))[:60]}")


def json_repr(value: Any) -> str:
    return "null" if value is None else repr(value)


def _cell_from_dict(path: Path, index: int, data: Any) -> CellResult:
    _check_fields(f"corrupt {path}: cell {index}", data, CELL_TYPES, CELL_REQUIRED)
    if not 0 <= data.get("seed", 0) <= MAX_SEED:
        raise ResultsError(f"corrupt {path}: cell {index}: seed must be an integer from 0 to {MAX_SEED}, "
                           f"got {str(data['seed'])[:60]}")
    for i, check in enumerate(data["checks"]):
        _check_fields(f"corrupt {path}: cell {index}: check {i}", check, CHECK_TYPES, ("name", "verdict", "reason"))
    try:
        return CellResult.from_dict(data)
    except KeyError as exc:
        raise ResultsError(f"corrupt {path}: cell {index} lacks the key {exc.args[0]!r}") from exc
    except (TypeError, ValueError, AttributeError) as exc:
        raise ResultsError(f"corrupt {path}: cell {index}: {exc}") from exc
