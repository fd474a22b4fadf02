"""The fault catalog: every known-bug injection, gathered from the `faults` modules beside the code each one
breaks (a fault is declared by its package, harness/engine/fault.py says what one is), and the engine switches a
fault name sets on a topology (`fault_flags`)."""

from __future__ import annotations

import dataclasses

from harness.core.errors import ConfigError
from harness.engine.fault import Fault, FaultFlags
from harness.engine.layers import dense_faults, dp_moe_faults, hybrid_faults, mla_faults, sparse_faults
from harness.engine.pd import faults as pd_faults
from harness.engine.runtime import faults as runtime_faults
from harness.engine.speculative import faults as speculative_faults
from harness.specs.loader import did_you_mean
from harness.specs.topology import Topology

# the modules that declare faults, each beside the code its faults break
DECLARING_MODULES = (runtime_faults, dense_faults, mla_faults, sparse_faults, hybrid_faults, dp_moe_faults,
                     speculative_faults, pd_faults)
FLAG_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(FaultFlags))


def _catalog() -> dict[str, Fault]:
    """name -> Fault over every declaring module; a name declared twice or a flag FaultFlags lacks is a bug here."""
    catalog: dict[str, Fault] = {}
    for module in DECLARING_MODULES:
        for fault in module.FAULTS:
            if fault.name in catalog:
                raise AssertionError(f"fault {fault.name} declared twice ({module.__name__})")
            unknown = set(fault.flags) - FLAG_FIELDS
            if not fault.flags or unknown:
                raise AssertionError(f"fault {fault.name} ({module.__name__}) sets no FaultFlags field or unknown "
                                     f"ones: {sorted(unknown)}")
            catalog[fault.name] = fault
    return catalog


FAULTS: dict[str, Fault] = _catalog()
# conditions of a correct engine's surroundings (P/D store damage, lost entries), not bugs
LOAD_CONDITIONS: dict[str, str] = pd_faults.LOAD_CONDITIONS

# Perturbations of a correct engine (not faults: no bug, only another reduction order). The noise run
# of a cell is the reference topology run under one of these, in the model's own dtype.
PERTURBATIONS: dict[str, FaultFlags] = {
    "noise-reduction-order": FaultFlags(split_reduction=4),
}


SHARED_JOIN = "+"  # "<perturbation>+<fault>": a noise run carrying a fault in code the reference runs too


def fault_flags(name: str | None, topology: Topology) -> FaultFlags:
    """The engine switches for fault `name` on `topology`; a fault that cannot apply is a ConfigError.
    "<perturbation>+<fault>" (the noise run of a shared fault, Fault.shared) sets both."""
    if name is None:
        return FaultFlags()
    if SHARED_JOIN in name:
        perturbation, fault = name.split(SHARED_JOIN, 1)
        if perturbation not in PERTURBATIONS or fault not in FAULTS or not FAULTS[fault].shared:
            raise ConfigError(f"fault {name!r}: '{SHARED_JOIN}' joins a perturbation ({', '.join(PERTURBATIONS)}) "
                              f"and a shared fault ({', '.join(n for n, f in FAULTS.items() if f.shared)})")
        return dataclasses.replace(fault_flags(fault, topology), **{
            f.name: getattr(PERTURBATIONS[perturbation], f.name) for f in dataclasses.fields(FaultFlags)
            if getattr(PERTURBATIONS[perturbation], f.name) != getattr(FaultFlags(), f.name)})
    if name in PERTURBATIONS:
        return PERTURBATIONS[name]
    if name in LOAD_CONDITIONS:
        if topology.prefill is None:
            raise ConfigError(f"load condition {name} needs a disaggregated topology (e.g. tp4>tp2), got "
                              f"{topology.name}")
        return FaultFlags(pd_lost_request=pd_faults.PD_LOST_REQUEST if name == "pd-load-lost" else -1,
                          pd_flaky_reads=name == "pd-load-flaky")
    if name not in FAULTS:
        known = (*FAULTS, *LOAD_CONDITIONS)
        raise ConfigError(f"unknown fault {name!r}{did_you_mean(name, known)}; valid: {', '.join(known)}")
    fault = FAULTS[name]
    if fault.needs_pd and topology.prefill is None:
        raise ConfigError(f"fault {name} needs a disaggregated topology (PREFILL>DECODE, e.g. tp4>tp2dcp2), "
                          f"got {topology.name}")
    if fault.needs_dcp and topology.dcp == 1:
        raise ConfigError(f"fault {name} needs a DCP topology (dcp > 1), got {topology.name}")
    if fault.needs_tp and topology.tp == 1:
        raise ConfigError(f"fault {name} needs a tensor-parallel topology (tp > 1), got {topology.name}")
    if fault.needs_placement and topology.placement.kind != fault.needs_placement or (
            fault.needs_placement == "interleave" and topology.placement.size == 1):
        example = f"tp{topology.tp}dcp{topology.dcp}" + ("i16" if fault.needs_placement == "interleave" else "c")
        raise ConfigError(f"fault {name} needs a {fault.needs_placement} DCP placement (e.g. {example}), "
                          f"got {topology.name}")
    if fault.needs_q_replicated and not topology.q_replicated:
        raise ConfigError(f"fault {name} needs a Q-replicated DCP topology (suffix q, e.g. "
                          f"tp{topology.tp}dcp{topology.dcp}q), got {topology.name}")
    wanted = fault.needs_speculator
    if wanted and (topology.speculator == "none" or wanted not in ("any", topology.speculator)):
        kind = "a -draft or -mtp" if wanted == "any" else f"a -{wanted}"
        raise ConfigError(f"fault {name} needs {kind} topology (speculative decoding), got {topology.name}")
    return FaultFlags(**fault.flags)
