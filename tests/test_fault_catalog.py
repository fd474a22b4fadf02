"""The fault catalog (harness/engine/faults.py) gathered from the declaring modules beside the code each fault breaks:
every fault declared once with the switches it sets, every engine switch set by some fault, the components' fault
names in it, and the catalog importable without torch (harness list and the HTTP backend read it)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from harness.arch.components import GatedDeltaNet, LatentAttention, MoE, SparseAttention
from harness.core.errors import ConfigError
from harness.engine.fault import Fault, FaultFlags
from harness.engine.faults import DECLARING_MODULES, FAULTS, LOAD_CONDITIONS, PERTURBATIONS, _catalog, fault_flags
from harness.specs.topology import parse_topology_name

# switches that no fault sets: the noise perturbation's reduction order and the flaky-read load condition
NOT_FAULT_SWITCHES = {"split_reduction", "pd_flaky_reads"}


def test_every_fault_is_declared_once_beside_its_code() -> None:
    declared = [f.name for m in DECLARING_MODULES for f in m.FAULTS]
    assert len(declared) == len(set(declared)) == len(FAULTS)
    for module in DECLARING_MODULES:  # harness.engine.<package>.faults or harness.engine.layers.<feature>_faults
        assert module.__name__.startswith("harness.engine.") and module.__name__.endswith("faults")


def test_every_engine_switch_is_set_by_some_fault() -> None:
    set_by_faults = {k for f in FAULTS.values() for k in f.flags}
    assert set_by_faults | NOT_FAULT_SWITCHES == {f.name for f in dataclasses.fields(FaultFlags)}


def test_components_name_only_catalogued_faults() -> None:
    for component in (LatentAttention, SparseAttention, GatedDeltaNet, MoE):
        assert component.faults <= set(FAULTS), component.name


def test_fault_flags_sets_exactly_the_declared_switches() -> None:
    fault = FAULTS["dcp-lse-merge"]
    flags = fault_flags("dcp-lse-merge", parse_topology_name("tp2dcp2"))
    default = FaultFlags()
    changed = {f.name for f in dataclasses.fields(FaultFlags) if getattr(flags, f.name) != getattr(default, f.name)}
    assert changed == set(fault.flags) == {"lse_merge_mean"}
    assert fault_flags("noise-reduction-order", parse_topology_name("tp1")) == PERTURBATIONS["noise-reduction-order"]
    assert "pd-load-lost" in LOAD_CONDITIONS


def test_a_fault_outside_its_scope_is_one_error() -> None:
    with pytest.raises(ConfigError, match="needs a DCP topology"):
        fault_flags("dcp-lse-merge", parse_topology_name("tp2"))


def test_a_broken_declaration_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Positive control of the catalog's own rules: a duplicate name or an unknown switch fails at import."""
    module = DECLARING_MODULES[0]
    monkeypatch.setattr(module, "FAULTS", (*module.FAULTS, module.FAULTS[0]))
    with pytest.raises(AssertionError, match="declared twice"):
        _catalog()
    monkeypatch.setattr(module, "FAULTS", (Fault("x-fault", "logits", "a typo", flags={"no_such_switch": True}),))
    with pytest.raises(AssertionError, match="no_such_switch"):
        _catalog()


def test_catalog_imports_no_torch() -> None:
    code = "import sys, harness.engine.faults, harness.engine.fault_scope; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
