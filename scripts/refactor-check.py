"""Whether a change that should change nothing (a move of modules, a new package layout) changed nothing: `harness plan`
and `harness run` outputs of two source trees, compared.

    python scripts/refactor-check.py capture TREE OUT     # the plan/run matrix of the source tree TREE into OUT
    python scripts/refactor-check.py compare OUT_A OUT_B  # every difference; exit 1 if there is one

`capture` runs TREE's harness (PYTHONPATH=TREE, this interpreter) over models x topologies for `harness plan` and a
set of suites, clean and with a fault each, for `harness run`; `compare` holds the plans byte-identical and every
cell's status, failure class, localization and each check's verdict, reason and metrics identical (run folders,
wall times and commands left out). Make a tree of the old commit with `git worktree add /tmp/before OLD`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

MODELS = ("tiny-gqa", "tiny-kv6", "tiny-mla", "tiny-hybrid", "tiny-dsa", "tiny-moe-dp", "tiny-dsv2-moe",
          "tiny-qwen3next", "tiny-bf16-big")
TOPOLOGIES = ("tp2", "tp4", "tp4dcp2", "tp4dcp4", "tp2-mtp", "tp4dcp2ep4", "tp4dp4ep4", "tp4>tp2dcp2", "tp4dcp2i4",
              "tp2dcp2q")
RUNS: dict[str, tuple[str, ...]] = {
    "dcp": ("--suite", "dcp", "--topo", "tp4dcp4"),
    "dcp-fault": ("--suite", "dcp", "--topo", "tp4dcp4", "--fault", "dcp-tp-kv-layout"),
    "tp": ("--suite", "tp", "--topo", "tp2,tp4"),
    "gqa-odd": ("--suite", "gqa-odd", "--topo", "tp4,tp3dcp3", "--fault", "gcd-naive-gqa"),
    "mla": ("--suite", "mla", "--topo", "tp2,tp4dcp2", "--workload", "prompts"),
    "mla-fault": ("--suite", "mla", "--topo", "tp4dcp2", "--fault", "dcp-lse-merge", "--workload", "prompts"),
    "hybrid": ("--suite", "hybrid", "--topo", "tp2,tp4dcp2ep4,tp2-mtp", "--workload", "prompts"),
    "hybrid-fault": ("--suite", "hybrid", "--topo", "tp4ep2", "--fault", "moe-expert-offset", "--workload", "prompts"),
    "dsa": ("--suite", "dsa", "--topo", "tp2dcp2", "--workload", "prompts"),
    "dsa-fault": ("--suite", "dsa", "--topo", "tp2dcp2", "--fault", "dsa-local-topk", "--workload", "prompts"),
    "moedp": ("--suite", "moe-dp", "--topo", "tp4dp4ep4", "--workload", "prompts"),
    "moedp-fault": ("--suite", "moe-dp", "--topo", "tp4dp4ep4", "--fault", "redundant-expert-twice",
                    "--workload", "prompts"),
    "pd": ("--suite", "pd", "--topo", "tp4>tp2dcp2", "--model", "tiny-gqa"),
    "pd-fault": ("--suite", "pd", "--topo", "tp4>tp2dcp2", "--model", "tiny-gqa", "--fault", "pd-block-owner"),
    "spec": ("--suite", "spec", "--topo", "tp4dcp4-mtp,tp1-draft"),
    "spec-fault": ("--suite", "spec", "--topo", "tp4dcp4-mtp", "--fault", "draft-stale-kv"),
}
VOLATILE_KEYS = {"wall_s", "run_dir", "reference_dir", "command", "error_log", "engine_build", "engine_env"}


def capture(tree: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    harness = [sys.executable, "-m", "harness"]
    for model in MODELS:
        for topo in TOPOLOGIES:
            done = subprocess.run([*harness, "plan", "--model", model, "--topo", topo, "--budget-gib", "1",
                                   "--format", "json"], cwd=tree, env=env, capture_output=True, text=True)
            name = f"plan-{model}-{topo.replace('>', '_')}.json"
            (out / name).write_text(done.stdout + done.stderr + f"rc={done.returncode}\n")
    for name, args in RUNS.items():
        done = subprocess.run([*harness, "run", *args, "--out", str(out / "runs" / name), "--cache-dir",
                               str(out / "cache")], cwd=tree, env=env, capture_output=True, text=True)
        (out / f"run-{name}.log").write_text(done.stdout + done.stderr + f"rc={done.returncode}\n")
        print(f"{name}: exit {done.returncode}", flush=True)


def _stable(value: Any) -> Any:
    """`value` without what differs between two checkouts of the same code (folders, times, commands)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"/[\w/.+-]*/(runs|cache|reports)/[\w/.+-]*", "PATH", value)
    return value


def compare(a: Path, b: Path) -> list[str]:
    """Every difference between two captures, one line each."""
    diffs = [f"plan {p.name} differs" for p in sorted(a.glob("plan-*.json"))
             if p.read_text() != (b / p.name).read_text()]
    for run in sorted(p.name for p in (a / "runs").iterdir()):
        cells = [{(c["model"], c["topology"], c["workload"], c["fault"]): _stable(c)
                  for c in json.loads((side / "runs" / run / "results.json").read_text())["cells"]} for side in (a, b)]
        if cells[0].keys() != cells[1].keys():
            diffs.append(f"{run}: cells {sorted(map(str, cells[0].keys() ^ cells[1].keys()))}")
            continue
        for key, cell in cells[0].items():
            other = cells[1][key]
            diffs += [f"{run} {key}: {field} {cell.get(field)!r} != {other.get(field)!r}"
                      for field in ("status", "silent_corruption", "failure_class", "localization")
                      if cell.get(field) != other.get(field)]
            checks = [{c["name"]: c for c in side["checks"]} for side in (cell, other)]
            diffs += [f"{run} {key}: check {name} differs" for name in sorted(checks[0].keys() | checks[1].keys())
                      if checks[0].get(name) != checks[1].get(name)]
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture")
    cap.add_argument("tree", type=Path)
    cap.add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "capture":
        capture(args.tree.resolve(), args.out.resolve())
        return 0
    diffs = compare(args.a, args.b)
    print("\n".join(diffs))
    print(f"{len(list(args.a.glob('plan-*.json')))} plans and {len(RUNS)} runs compared: {len(diffs)} differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
