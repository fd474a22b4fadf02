"""A speculative cell with workloads: each workload's speculative generation runs that workload's own
token count (as its plain generation does), so `lossless` compares like with like; the self-consistency
workload then passes in the spec suite (negative control), while a fault in the speculator still FAILs it
(positive control)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from harness.cli import main


def _cell(out: Path) -> tuple[dict, dict[str, str]]:
    (cell,) = json.loads((out / "results.json").read_text())["cells"]
    return cell, {c["name"]: c["verdict"] for c in cell["checks"]}


def test_speculative_generation_runs_each_workload_s_token_count(tmp_path: Path) -> None:
    rc = main(["run", "--suite", "spec", "--topo", "tp1-mtp", "--workload", "self-consistency",
               "--out", str(tmp_path / "clean"), "--cache-dir", str(tmp_path / "cache")])
    cell, verdicts = _cell(tmp_path / "clean")
    assert rc == 0 and cell["status"] == "PASS", cell
    assert verdicts["lossless"] == verdicts["self_consistency"] == "PASS"
    tensors = {}
    for f in sorted(tmp_path.rglob("*tp1-mtp*/tensors.safetensors")):  # the run (the tp1-mtp reference itself)
        tensors.update(load_file(str(f)))
    spec = [t for k, t in tensors.items() if k.startswith("spec_tokens.")]
    assert spec and all(isinstance(t, torch.Tensor) and t.numel() <= 6 for t in spec)  # the workload's 6, not 24
    rc = main(["run", "--suite", "spec", "--topo", "tp1-mtp", "--workload", "self-consistency", "--fault",
               "draft-stale-kv", "--out", str(tmp_path / "fault"), "--cache-dir", str(tmp_path / "cache")])
    cell, verdicts = _cell(tmp_path / "fault")
    assert rc == 1 and cell["status"] == "FAIL", verdicts
