"""The cell list of a run (`harness matrix`): every cell the runner would run, as MatrixCell lines.

Built from the runner's own plan, so a line's command, reference key and server are the ones `harness run` uses;
estimates come from the launch times the history store recorded (harness/records/history.py: measured_seconds),
else from the cost model of harness/records/shard.py.
"""

from __future__ import annotations

from pathlib import Path

from harness.backends.http.pool import server_need
from harness.flow.runner import Runner, seeded
from harness.records.cells import ESTIMATE_HISTORY, ESTIMATE_MODEL, MatrixCell, nodes_needed
from harness.records.history import measured_seconds
from harness.records.shard import cell_cost

# The cost model in seconds: cell_cost's units scaled so that a 2-rank cell of the shipped tiny models is about
# 3 s (2-core box). Only used for cells the history has not timed; only ratios matter to the split.
SECONDS_PER_COST_UNIT = 0.5


def matrix_cells(runner: Runner, history: Path | None = None, gpus_per_node: int = 8) -> list[MatrixCell]:
    """Every cell of the runner's plan (its --gpus, --cells and shard applied), one per workload, in plan order."""
    measured = measured_seconds(history)
    suite = runner.req.suite.name
    out = []
    for cell in runner.planned():
        topo = cell.topology
        timed = measured.get((suite, cell.model.name, topo.name, cell.fault or ""))
        estimate = timed if timed is not None else SECONDS_PER_COST_UNIT * cell_cost(
            topo.world_size, topo.speculator != "none", cell.skip_reason is not None)
        model = seeded(cell.model, cell.seed, runner.reseeds)
        for workload in (w for w in runner.workload_names if runner.wanted(cell, w)):
            out.append(MatrixCell(
                id=runner.cell_id(cell, workload), launch=runner.launch_id(cell), suite=suite,
                model=cell.model.name, topology=topo.name, fault=cell.fault, seed=cell.seed, workload=workload,
                gpus=topo.world_size, nodes=nodes_needed(topo.world_size, gpus_per_node),
                server=server_need(model, model.dtype, topo),
                reference="" if cell.skip_reason else runner.reference_key(cell),
                estimate_s=round(estimate, 2),
                estimate_source=ESTIMATE_HISTORY if timed is not None else ESTIMATE_MODEL,
                command=runner.command(cell, workload), skip=cell.skip_reason))
    return out
