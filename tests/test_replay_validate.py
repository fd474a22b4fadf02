"""Stored runs replayed as an engine, the artifacts contract validator, the inputs check's positive
controls (tampered hashes) and the per-cell reproduce command, over one real run."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from harness.cli import main
from harness.records.results import results_cells

SUITE = """
name: replayed
version: 1
models: [tiny-gqa]
topologies: [tp2]
max_new_tokens: 6
decode_prefix_tokens: 2
prompts: ["The capital of France is", "Q: 17 + 25 = ?"]
"""


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of the suite (given by path, with pool flags), its cache and results."""
    root = tmp_path_factory.mktemp("stored")
    suite = root / "replayed.yaml"
    suite.write_text(SUITE)
    out, cache = root / "out", root / "cache"
    rc = main(["run", "--suite", str(suite), "--topo", "tp2", "--kv-budget-mib", "5", "--max-seq-len", "100",
               "--out", str(out), "--cache-dir", str(cache)])
    assert rc == 0
    (cell,) = results_cells(out)
    return {"suite": suite, "out": out, "cache": cache, "cell": cell, "root": root}


def _verdicts(cell: dict) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in cell["checks"]}


def _replay(stored: dict, runs: Path, out: Path) -> tuple[int, dict]:
    rc = main(["run", "--suite", str(stored["suite"]), "--topo", "tp2", "--kv-budget-mib", "5", "--max-seq-len",
               "100", "--engine", f"replay:{runs}", "--reference-engine", "embedded", "--out", str(out),
               "--cache-dir", str(stored["cache"])])
    (cell,) = results_cells(out)
    return rc, cell


def _copy_runs(stored: dict, dest: Path) -> Path:
    shutil.copytree(stored["out"] / "runs", dest)
    return dest / "tiny-gqa" / "tp2" / "seed0"


def test_validate_accepts_every_run_the_harness_writes(stored: dict, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [Path(stored["cell"]["run_dir"]), *sorted((stored["cache"] / "runs").iterdir())]
    assert len(runs) == 3  # the parallel run, the reference and its noise run
    assert main(["validate", *map(str, runs)]) == 0
    assert capsys.readouterr().out.count(": ok") == 3


def test_validate_rejects_a_tampered_run_naming_the_artifact(stored: dict, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy_runs(stored, tmp_path / "runs")
    tensors = load_file(str(run / "tensors.safetensors"))
    del tensors["decode_logits.1"]
    tensors["gen_tokens.0"] = tensors["gen_tokens.0"].float()
    save_file(tensors, str(run / "tensors.safetensors"))
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["seed"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert main(["validate", str(run)]) == 1
    out = capsys.readouterr().out
    assert "manifest.json lacks 'seed'" in out
    manifest["seed"] = 0
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert main(["validate", str(run)]) == 1
    out = capsys.readouterr().out
    assert "tensors.safetensors lacks decode_logits.1" in out
    assert "gen_tokens.0 has dtype torch.float32, expected torch.int64" in out


def test_validate_reads_the_layout_schema_version_and_every_rank_report(stored: dict, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """layout.json records its rank report schema; a folder written before the key existed (same shape)
    still validates, another version is refused, and a mistyped field is named with its rank."""
    run = _copy_runs(stored, tmp_path / "runs")
    layout = json.loads((run / "layout.json").read_text())
    assert layout["schema_version"] == 1 and len(layout["target"]["ranks"]) == 2
    old = {k: v for k, v in layout.items() if k != "schema_version"}
    (run / "layout.json").write_text(json.dumps(old))
    assert main(["validate", str(run)]) == 0
    (run / "layout.json").write_text(json.dumps({**layout, "schema_version": 2}))
    assert main(["validate", str(run)]) == 1
    assert "layout.json has rank report schema 2; this harness reads schema 1" in capsys.readouterr().out
    layout["target"]["ranks"][1]["kv_pool_blocks"] = "many"
    (run / "layout.json").write_text(json.dumps(layout))
    assert main(["validate", str(run)]) == 1
    assert "layout.json target rank 1: field 'kv_pool_blocks' is 'many' (str), expected an integer" in \
        capsys.readouterr().out


def test_replayed_runs_give_the_same_verdicts(stored: dict, tmp_path: Path) -> None:
    rc, cell = _replay(stored, stored["out"] / "runs", tmp_path / "out")
    assert rc == 0 and cell["engine"] == "replay" and cell["reference_engine"] == "embedded"
    assert _verdicts(cell) == _verdicts(stored["cell"])


@pytest.mark.parametrize("key,label", [("weights_hash", "weights hash"), ("prompts_hash", "prompts hash"),
                                       ("tokenizer_hash", "tokenizer hash")])
def test_inputs_check_fails_a_run_with_other_inputs(stored: dict, tmp_path: Path, key: str, label: str) -> None:
    run = _copy_runs(stored, tmp_path / "runs")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest[key] = "0" * 64
    (run / "manifest.json").write_text(json.dumps(manifest))
    rc, cell = _replay(stored, tmp_path / "runs", tmp_path / "out")
    inputs = next(c for c in cell["checks"] if c["name"] == "inputs")
    assert rc == 1 and inputs["verdict"] == "FAIL"
    assert inputs["reason"].startswith(f"inputs differ: {label} differs: reference ")
    assert "parallel 000000000000" in inputs["reason"]


def test_a_malformed_replayed_run_is_one_error_cell(stored: dict, tmp_path: Path) -> None:
    run = _copy_runs(stored, tmp_path / "runs")
    tensors = load_file(str(run / "tensors.safetensors"))
    del tensors["hidden.0"]
    save_file(tensors, str(run / "tensors.safetensors"))
    rc, cell = _replay(stored, tmp_path / "runs", tmp_path / "out")
    assert rc == 3 and cell["status"] == "ERROR"
    (check,) = cell["checks"]
    assert check["reason"] == "parallel run breaks the artifacts contract: tensors.safetensors lacks hidden.0"


def test_the_reproduce_command_reruns_exactly_that_cell(stored: dict, tmp_path: Path) -> None:
    argv = shlex.split(stored["cell"]["command"])
    assert argv[:2] == ["harness", "run"]
    assert argv[argv.index("--suite") + 1] == str(stored["suite"].resolve())
    assert argv[argv.index("--kv-budget-mib") + 1] == "5" and argv[argv.index("--max-seq-len") + 1] == "100"
    out = tmp_path / "again"
    assert main([*argv[1:], "--out", str(out), "--cache-dir", str(stored["cache"])]) == 0
    (cell,) = results_cells(out)
    assert _verdicts(cell) == _verdicts(stored["cell"])
    assert cell["command"] == stored["cell"]["command"]
    manifest = json.loads((Path(cell["run_dir"]) / "manifest.json").read_text())
    assert manifest["topology"]["name"] == "tp2"
    layout = json.loads((Path(cell["run_dir"]) / "layout.json").read_text())
    assert layout["target"]["pool"]["budget_bytes"] == 5 << 20 and layout["target"]["pool"]["max_seq_len"] == 100
