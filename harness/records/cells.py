"""The matrix as data: one JSON line per cell of a run (`harness matrix`), read back by `harness run --cells-from`.

A cell is (suite, model, topology, fault, seed, workload); its id is `cell_id` of those, the one spelling that
`--cells`, `harness history cell` and `harness bisect --cell` take. The cells of one launch (the workloads of one
model x topology x fault x seed) share a `launch` id: a scheduler splits the matrix by launches, since one launch
runs all of its workloads. Each line also says what the cell needs (GPUs, nodes), the engine configuration whose
server it shares, the reference run it depends on (its cache key), its estimated seconds and where the estimate
came from, and the exact command that runs it alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from harness.core.errors import ConfigError

ESTIMATE_HISTORY = "history"  # the median wall time of the cell's recorded launches
ESTIMATE_MODEL = "model"      # the cost model of harness/records/shard.py, in seconds


def cell_id(suite: str, model: str, topology: str, fault: str | None, seed: int, workload: str) -> str:
    """'suite/model/topology[+fault]/seedN/workload': unique within a run, readable in a shell."""
    return f"{suite}/{model}/{topology}{'+' + fault if fault else ''}/seed{seed}/{workload}"


def launch_id(suite: str, model: str, topology: str, fault: str | None, seed: int) -> str:
    """The launch a cell belongs to: its id without the workload."""
    return f"{suite}/{model}/{topology}{'+' + fault if fault else ''}/seed{seed}"


@dataclass(frozen=True)
class MatrixCell:
    """One line of `harness matrix`."""

    id: str
    launch: str
    suite: str
    model: str
    topology: str
    fault: str | None
    seed: int
    workload: str
    gpus: int               # ranks of the parallel run (one GPU each)
    nodes: int              # machines it spans at --gpus-per-node
    server: str             # the engine configuration it shares a server with (server_need digest)
    reference: str          # the reference run's cache key ("" for a cell that does not run)
    estimate_s: float
    estimate_source: str    # ESTIMATE_HISTORY or ESTIMATE_MODEL
    command: str
    skip: str | None = None  # why the cell cannot run (a SKIP in the report), else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=False)


def nodes_needed(gpus: int, gpus_per_node: int) -> int:
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node} must be >= 1")
    return max(1, math.ceil(gpus / gpus_per_node))


_FIELDS = tuple(MatrixCell.__dataclass_fields__)


def read_cells(path: Path) -> list[MatrixCell]:
    """The lines of a `harness matrix` file; a missing file or a line that is not a cell is one ConfigError
    naming the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--cells-from {path}: cannot read it ({exc.strerror or exc})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            missing = [f for f in ("id", "launch", "suite", "estimate_s") if f not in doc]
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
            out.append(MatrixCell(**{k: doc[k] for k in _FIELDS if k in doc}))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--cells-from {path} line {n} is not a cell of `harness matrix` ({exc})") from None
    if not out:
        raise ConfigError(f"--cells-from {path} holds no cells (write it with: harness matrix ... > {path.name})")
    return out


def parse_ids(text: str) -> list[str]:
    """--cells ID,ID,...: the ids, stripped; an empty list is one ConfigError."""
    ids = [i.strip() for i in text.split(",") if i.strip()]
    if not ids:
        raise ConfigError(f"--cells {text!r} names no cell (give ids as `harness matrix` prints them)")
    return ids


def resolve_ids(wanted: Iterable[str], known: Sequence[str], flag: str) -> set[str]:
    """The wanted ids, each one of `known` (a cell id of this run, or a launch id meaning all its workloads);
    an unknown one is one ConfigError naming it and a few valid ones."""
    known_set = set(known)
    launches: dict[str, list[str]] = {}
    for i in known:
        launches.setdefault(i.rsplit("/", 1)[0], []).append(i)
    out: set[str] = set()
    for i in wanted:
        if i in known_set:
            out.add(i)
        elif i in launches:
            out.update(launches[i])
        else:
            near = [k for k in known if i.split("/")[0] in k][:3] or list(known[:3])
            raise ConfigError(f"{flag}: {i!r} is not a cell of this run; its cells look like "
                              f"{', '.join(near)} (harness matrix lists them all)")
    return out


def launch_estimates(cells: Sequence[MatrixCell]) -> dict[str, float]:
    """Estimated seconds per launch (its workloads' cells share one launch: the largest of them)."""
    out: dict[str, float] = {}
    for c in cells:
        out[c.launch] = max(out.get(c.launch, 0.0), 0.0 if c.skip else float(c.estimate_s))
    return out


def summary(cells: Sequence[MatrixCell]) -> dict[str, Any]:
    """Counts a scheduler sizes its jobs by: cells, launches, GPU classes, estimated seconds."""
    by_gpus: dict[int, int] = {}
    for c in cells:
        by_gpus[c.gpus] = by_gpus.get(c.gpus, 0) + 1
    return {"cells": len(cells), "launches": len({c.launch for c in cells}),
            "by_gpus": dict(sorted(by_gpus.items())),
            "estimate_s": round(sum(launch_estimates(cells).values()), 1)}
