"""Merging the results of several run folders into one set of cells (`harness report A B ...`).

Cells are identified by (suite, model, topology, fault, seed, workload): cell_key, the one identity
results.json, the report and the sign-off use. When the same cell appears in
several folders, the one from the folder given LATER wins (a re-run of a cell replaces the earlier
result) and keeps the position where the cell first appeared. The merged provenance keeps the
fields every source agrees on and lists each source under "sources".
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.core.verdict import CellResult
from harness.records.results import read_results
from harness.specs.workload import SUITE_PROMPTS

CellKey = tuple[str, str, str, str | None, int, str]  # (suite, model, topology, fault, seed, workload)


def cell_key(cell: CellResult) -> CellKey:
    """A cell's identity: no two cells of one set of results share it."""
    return (cell.suite, cell.model, cell.topology, cell.fault, cell.seed, cell.workload)


def key_label(key: CellKey) -> str:
    """'suite/model/topology[/fault][/workload]/seedN' (the workload named unless it is the suite's prompts)."""
    suite, model, topology, fault, seed, workload = key
    parts = (suite, model, topology, fault, "" if workload == SUITE_PROMPTS else workload)
    return "/".join(p for p in parts if p) + f"/seed{seed}"


def merge_cells(groups: list[list[CellResult]]) -> list[CellResult]:
    """All cells, later duplicates replacing earlier ones in place."""
    merged: dict[CellKey, CellResult] = {}
    for cells in groups:
        for cell in cells:
            merged[cell_key(cell)] = cell
    return list(merged.values())


def merge_provenance(sources: list[tuple[Path, dict[str, Any], str]]) -> dict[str, Any]:
    """Fields with one value across all sources, plus "sources": [{dir, run_id, provenance}]."""
    provs = [p for _, p, _ in sources]
    common = {k: v for k, v in provs[0].items() if k != "sources" and all(p.get(k) == v for p in provs[1:])}
    common["sources"] = [{"dir": str(d), "run_id": run_id, "provenance": p} for d, p, run_id in sources]
    return common


def merge(dirs: list[Path]) -> tuple[list[CellResult], dict[str, Any], str]:
    """Read each folder's results.json; one folder is returned as is, several are merged."""
    if not dirs:
        raise ValueError("merge needs at least one run folder")
    read = [(d, *read_results(d)) for d in dirs]
    if len(read) == 1:
        _, cells, provenance, run_id = read[0]
        return cells, provenance, run_id
    cells = merge_cells([c for _, c, _, _ in read])
    provenance = merge_provenance([(d, p, r) for d, _, p, r in read])
    run_id = "merged-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return cells, provenance, run_id
