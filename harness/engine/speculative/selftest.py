"""Speculative decoding under torchrun without the worker: `python -m harness.engine.speculative.selftest
CONFIG.json`, one process per rank (world size tp). Builds the target once, decodes the prompts plainly,
then once per (speculator kind, fault) case with a fresh speculator, and rank 0 writes one JSON:

  {"topology": {...}, "plain": [[ids]], "target_layout": [rank reports],
   "cases": [{"kind", "fault", "tokens": [[ids]], "accepted": [[counts]], "summary": {...},
              "layout": <layout.json "speculator" entry>}]}

CONFIG.json: {"model": ModelSpec dict, "tp", "dcp", "prompts": [[ids]], "max_new_tokens",
              "speculative": SpeculativeSettings mapping, "cases": [[kind, fault or null]],
              "pool": PoolSettings mapping, "out": path}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from harness.core.limits import COLLECTIVE_TIMEOUT_S
from harness.engine.faults import fault_flags
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import generate, run_speculative_cases
from harness.engine.speculative.speculator import speculator_for
from harness.formats.weights import load_weights
from harness.specs.model import model_from_dict
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from harness.specs.topology import Topology


def run(config: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank runs this; rank 0 returns the results (others None)."""
    tp, dcp = int(config["tp"]), int(config["dcp"])
    state = ParallelState.from_launcher(tp, dcp, "cpu", COLLECTIVE_TIMEOUT_S)
    spec = model_from_dict("selftest", config["model"])
    weights = load_weights(spec)
    pool = PoolSettings(**config.get("pool", {}))
    settings = SpeculativeSettings.from_mapping(config.get("speculative"))
    prompts = [list(p) for p in config["prompts"]]
    target = Engine(spec, weights, state, pool=pool)
    plain = generate(target, prompts, config["max_new_tokens"]).tokens
    target_layout = [r.to_json() for r in state.gather_objects(target.layout_report())]
    out: dict[str, Any] = {"topology": {"tp": tp, "dcp": dcp}, "plain": plain, "target_layout": target_layout,
                           "cases": []}
    for kind, fault in config["cases"]:
        flags = fault_flags(fault, Topology(tp=tp, dcp=dcp, speculator=kind))
        case_target = target if fault is None else Engine(spec, weights, state, flags, pool)
        speculator = speculator_for(case_target, kind, weights, settings)
        result = run_speculative_cases(case_target, speculator, prompts, settings.k, config["max_new_tokens"])
        ranks = state.gather_objects(speculator.layout_report())
        out["cases"].append({"kind": kind, "fault": fault, "tokens": result.tokens, "accepted": result.accepted,
                             "summary": result.summary(), "layout": speculator.layout_entry(ranks)})
    state.barrier()
    state.shutdown()
    return out if state.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m harness.engine.speculative.selftest CONFIG.json", file=sys.stderr)
        return 2
    config = json.loads(Path(args[0]).read_text())
    result = run(config)
    if result is not None:
        Path(config["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
