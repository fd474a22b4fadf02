"""`harness run` end to end over real gloo runs: verdicts, faults as silent corruption, exit codes,
a killed rank as an ERROR cell, and the report files."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness.backends.embedded.worker import INJECT_ENV
from harness.cli import main
from harness.records.results import read_results, results_cells
from tests.conftest import TEST_LAUNCH_TIMEOUT_S, TEST_LAUNCHES_PER_TEST

SMALL_SUITE = """
name: small
version: 1
models: [tiny-gqa]
topologies: [tp2, tp2dcp2]
max_new_tokens: 8
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 128
prompts: ["The capital of France is", "<script>alert(1)</script> & more"]
checks: {layout: {}, logits: {}, generation: {}}
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "small.yaml"
    path.write_text(SMALL_SUITE)
    return path


def _results(out: Path) -> dict:
    return {**json.loads((out / "results.json").read_text()), "cells": results_cells(out)}  # paths made absolute


def test_main_command_passes_and_writes_every_report_file(tmp_path: Path, cache_dir: Path) -> None:
    """The README's main command, as a user runs it (fresh process)."""
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--suite", "dcp", "--topo", "tp4dcp4",
                           "--out", str(out), "--cache-dir", str(cache_dir)],
                          capture_output=True, text=True, timeout=3 * TEST_LAUNCH_TIMEOUT_S, env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"report: {out / 'index.html'}" in proc.stdout
    doc = _results(out)
    assert sorted({cell["model"] for cell in doc["cells"]}) == ["tiny-bf16-big", "tiny-gqa"]  # float32 GQA, bf16 MHA
    for model in ("tiny-bf16-big", "tiny-gqa"):  # one cell per workload of the suite
        assert [c["workload"] for c in doc["cells"] if c["model"] == model] == [
            "prompts", "lengths", "prefix-cache", "self-consistency"]
    for cell in doc["cells"]:
        assert (cell["topology"], cell["status"], cell["silent_corruption"]) == ("tp4dcp4", "PASS", False)
        teacher_forced = {"logits_prefill", "logits_decode"} if cell["workload"] in ("prompts", "lengths") else set()
        assert {c["name"] for c in cell["checks"]} >= {"inputs", "layout", "generation", *teacher_forced}
    for name in ("index.html", "junit.xml", "summary.md"):
        assert (out / name).stat().st_size > 0


def test_set_runs_each_topology_once_and_the_reference_once(tmp_path: Path, suite_file: Path, cache_dir: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--suite", str(suite_file), "--topo", "tp2,tp2dcp2,tp2", "--out", str(tmp_path / "a"),
               "--cache-dir", str(cache_dir)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert [c["topology"] for c in _results(tmp_path / "a")["cells"]] == ["tp2", "tp2dcp2"]
    assert out.count("reference tiny-gqa tp1 float32 seed 0") == 1
    # a second run reuses the cached reference
    assert main(["run", "--suite", str(suite_file), "--topo", "tp2", "--out", str(tmp_path / "b"),
                 "--cache-dir", str(cache_dir)]) == 0
    assert "float32 seed 0: cached" in capsys.readouterr().out


@pytest.mark.parametrize(("fault", "model", "topo", "heads", "ranks"), [
    ("dcp-tp-kv-layout", "tiny-gqa", "tp4dcp4", list(range(8)), [0, 1, 2, 3]),
    ("dcp-lse-merge", "tiny-gqa", "tp4dcp4", list(range(8)), [0, 1, 2, 3]),
    ("dcp-token-owner", "tiny-gqa", "tp4dcp4", list(range(8)), [0, 1, 2, 3]),
    # heads=24 kv=6 tp=4: the naive local mapping is wrong for Q heads 2-9 and 14-21 only
    ("gcd-naive-gqa", "tiny-kv6", "tp4", [2, 3, 4, 5, 6, 7, 8, 9, 14, 15, 16, 17, 18, 19, 20, 21], [0, 1, 2, 3]),
    # precision regressions of a collective: named as the communication step, on both ranks
    ("fp16-attn-allreduce", "tiny-gqa", "tp2", [], [0, 1]),
    ("bf16-allreduce", "tiny-gqa", "tp2", [], [0, 1]),
    # ragged batch padding stored as keys under DCP: only the ragged teacher-forced decode path sees it
    ("dcp-store-padding", "tiny-gqa", "tp2dcp2", None, [0, 1]),
])
def test_fault_is_flagged_as_silent_corruption_with_localization(
        tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str, model: str, topo: str,
        heads: list[int] | None, ranks: list[int]) -> None:
    rc = main(["run", "--suite", str(suite_file), "--model", model, "--topo", topo, "--fault", fault,
               "--out", str(tmp_path), "--cache-dir", str(cache_dir)])
    assert rc == 1
    (cell,) = _results(tmp_path)["cells"]
    assert cell["status"] == "FAIL" and cell["silent_corruption"] is True
    assert cell["fault"] == fault
    loc = cell["localization"]
    assert loc["layer"] == 0 and loc["ranks"] == ranks, loc
    assert heads is None or loc["heads"] == heads, loc
    verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
    assert verdicts["logits_decode"] == "FAIL"
    if fault == "dcp-lse-merge":
        assert "DCP LSE merge" in loc["summary"]
    # the collectives check: FAILs where a communication step itself is wrong, not on wrong inputs
    assert verdicts["collectives"] == ("FAIL" if fault.endswith("allreduce") or fault == "dcp-lse-merge" else "PASS")
    if fault.endswith("allreduce"):
        assert "TP all-reduce of the attention output projection is wrong on ranks 0-1" in loc["summary"]
        assert verdicts["logits_prefill"] == "FAIL"  # a FAIL, not a WARN: far beyond a correct run's noise
    if fault == "dcp-tp-kv-layout":
        assert verdicts["layout"] == "FAIL" and "KV head ids differ inside DCP group 0" in loc["summary"]
    if fault == "dcp-token-owner":
        assert verdicts["logits_prefill"] == "PASS"  # the bug lives in decode only
    if fault == "gcd-naive-gqa":  # the summary names what the ranks really read, not the plan
        assert "heads 2-9,14-21 read the wrong KV heads (e.g. head 2 reads 1, planned 0)" in loc["summary"]
    html = (tmp_path / "index.html").read_text()
    assert "silent" in html.lower() and f"--fault {fault}" in html


# uneven splits (tiny-fp16-big: vocab 383, ffn 290 at tp4) and DCP positions: (fault, model, topology,
# the layout check's first problem or None, the localization summary's start)
SPLIT_FAULTS = [
    ("vocab-shard-offset", "tiny-fp16-big", "tp4", "rank 1 holds vocab rows (token ids) 95-190, planned 96-191",
     ("output head", "embeddings")),
    ("ffn-floor-split", "tiny-fp16-big", "tp4", "rank 1 holds FFN columns 72-143, planned 72-144",
     ("layer 0: residual stream diverges",)),
    ("dcp-rope-local-pos", "tiny-gqa", "tp2dcp2", None, ("layer 0 attention: heads 0-7 on ranks 0-1",)),
]


@pytest.mark.parametrize(("fault", "model", "topo", "layout_problem", "summary"), SPLIT_FAULTS)
def test_split_fault_is_flagged_with_localization(tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str,
                                                  model: str, topo: str, layout_problem: str | None,
                                                  summary: tuple[str, ...]) -> None:
    rc = main(["run", "--suite", str(suite_file), "--model", model, "--topo", topo, "--fault", fault,
               "--out", str(tmp_path), "--cache-dir", str(cache_dir)])
    assert rc == 1
    (cell,) = _results(tmp_path)["cells"]
    assert cell["status"] == "FAIL" and cell["silent_corruption"] is True
    verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
    reasons = {c["name"]: c["reason"] for c in cell["checks"]}
    assert verdicts["logits_prefill"] == verdicts["logits_decode"] == "FAIL", reasons
    loc = cell["localization"]["summary"]
    assert loc.startswith(summary), loc
    if layout_problem is None:
        assert verdicts["layout"] == "PASS"
    else:
        assert verdicts["layout"] == "FAIL" and reasons["layout"].startswith(layout_problem)
        assert f"layout: {layout_problem}" in loc  # the localization names what the rank holds


# oneDNN's kernels for half precision differ by CPU (AVX512-FP16 and AMX where present): this caps them at
# AVX-512 without FP16/AMX, so the fault below is localized on both kernel paths of a machine that has both
KERNEL_PATHS = [{}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}]


@pytest.mark.parametrize("isa", KERNEL_PATHS, ids=["default-kernels", "no-fp16-amx-kernels"])
def test_split_fault_localization_does_not_depend_on_the_half_precision_kernels(tmp_path: Path, suite_file: Path,
                                                                                isa: dict[str, str]) -> None:
    """ffn-floor-split on the float16 model: layer 0 on either kernel path (each its own noise run: a fresh
    cache per path, the CLI in a fresh process with the path's environment)."""
    done = subprocess.run([sys.executable, "-m", "harness", "run", "--suite", str(suite_file), "--model",
                           "tiny-fp16-big", "--topo", "tp4", "--fault", "ffn-floor-split", "--out", str(tmp_path / "r"),
                           "--cache-dir", str(tmp_path / "cache")], env={**os.environ, **isa}, capture_output=True,
                          text=True, timeout=TEST_LAUNCH_TIMEOUT_S)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    (cell,) = _results(tmp_path / "r")["cells"]
    assert cell["localization"]["summary"].startswith("layer 0: residual stream diverges"), cell["localization"]


def test_uneven_vocab_and_ffn_splits_pass_clean_with_the_planned_shards(tmp_path: Path, suite_file: Path,
                                                                        cache_dir: Path) -> None:
    """The negative control of the split faults: vocab 383 and FFN 290 over tp4, vocab-parallel."""
    assert main(["run", "--suite", str(suite_file), "--model", "tiny-fp16-big", "--topo", "tp4",
                 "--out", str(tmp_path), "--cache-dir", str(cache_dir)]) == 0
    (cell,) = _results(tmp_path)["cells"]
    assert cell["status"] == "PASS", cell["checks"]
    collectives = next(c for c in cell["checks"] if c["name"] == "collectives")
    assert collectives["verdict"] == "PASS" and collectives["metrics"]["max_fraction_of_bound"] <= 1.0
    layout = json.loads((Path(cell["run_dir"]) / "layout.json").read_text())["target"]["ranks"]
    assert [r["vocab_shard"] for r in layout] == [[0, 96], [96, 192], [192, 288], [288, 383]]
    assert [r["ffn_shard"] for r in layout] == [[0, 72], [72, 145], [145, 217], [217, 290]]


def test_half_precision_collective_regression_fails_where_the_logits_stay_near_noise(
        tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    """bf16 all-reduce in a float16 model at tp2: the logits move only a few times their noise (they
    pass), the collectives check bounds each all-reduce by float16 rounding and FAILs it, localized to
    the first all-reduce on both ranks (the negative control: the clean tp4 run above passes it)."""
    assert main(["run", "--suite", str(suite_file), "--model", "tiny-fp16-big", "--topo", "tp2",
                 "--fault", "bf16-allreduce", "--out", str(tmp_path), "--cache-dir", str(cache_dir)]) == 1
    (cell,) = _results(tmp_path)["cells"]
    checks = {c["name"]: c for c in cell["checks"]}
    assert cell["status"] == "FAIL" and cell["silent_corruption"], checks
    assert checks["collectives"]["verdict"] == "FAIL"
    broken = checks["collectives"]["metrics"]["first_broken"]
    assert broken["error"] > 2 * broken["bound"]
    assert cell["localization"]["ranks"] == [0, 1]
    assert cell["localization"]["summary"].startswith("layer 0: TP all-reduce of the attention output projection")


def test_killed_rank_is_an_error_cell_and_other_cells_complete(tmp_path: Path, suite_file: Path,
                                                              cache_dir: Path) -> None:
    env = {**os.environ, INJECT_ENV: "crash:1"}
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--suite", str(suite_file), "--topo", "tp1,tp2",
                           "--out", str(tmp_path), "--cache-dir", str(cache_dir)],
                          capture_output=True, text=True, timeout=TEST_LAUNCHES_PER_TEST * TEST_LAUNCH_TIMEOUT_S,
                          env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    cells = {c["topology"]: c for c in _results(tmp_path)["cells"]}
    assert cells["tp1"]["status"] == "PASS"
    assert cells["tp2"]["status"] == "ERROR" and cells["tp2"]["silent_corruption"] is False
    assert "injected failure: crash on rank 1" in cells["tp2"]["error_log"]


def test_a_second_run_into_the_same_out_keeps_the_first_runs_results(tmp_path: Path, suite_file: Path,
                                                                     cache_dir: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out; echo $(id) 'it's"  # the provenance command is shell-quoted, as each cell's command is
    argv = ["run", "--suite", str(suite_file), "--topo", "tp2", "--out", str(out), "--cache-dir", str(cache_dir)]
    assert main(argv) == 0
    assert shlex.split(read_results(out)[1]["command"]) == ["harness", *argv]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error: --out") and str(out / "results.json") in err[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing replaced or added
    assert [c.status.value for c in read_results(out)[0]] == ["PASS"]


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--suite", "dcp", "--topo", "tp4dcp3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dcp=3 does not divide tp=4" in err[0]
    assert main(["run", "--suite", "dcp", "--topo", "tp4dcp4", "--fault", "dcp-lse-merj",
                 "--out", str(tmp_path)]) == 2
    assert "did you mean 'dcp-lse-merge'" in capsys.readouterr().err
    assert main(["run", "--suite", "nope"]) == 2


def test_model_that_cannot_split_is_one_error_before_anything_runs(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--suite", "gqa-odd", "--model", "tiny-9h3kv", "--topo", "tp4", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "heads=9 is not divisible by tp=4" in err[0]
    assert not (tmp_path / "results.json").exists()


def test_bad_checkpoint_is_one_error_before_any_rank(tmp_path: Path, suite_file: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint folder without a tokenizer, then with a truncated safetensors file: each is one
    exit-2 line from `harness run --model DIR`, and nothing is launched or written."""
    from harness.formats.hf.write import save_hf_checkpoint
    from harness.formats.locate import load_model
    from harness.formats.weights import load_weights

    spec = load_model("tiny-gqa")
    folder = save_hf_checkpoint(spec, load_weights(spec), tmp_path / "ckpt")
    argv = ["run", "--suite", str(suite_file), "--model", str(folder), "--topo", "tp2dcp2",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tokenizer.json" in err[0]
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "safetensors" in err[0] and str(weights) in err[0]
    assert not (tmp_path / "out").exists()


def test_damaged_reference_cache_entry_is_run_again(tmp_path: Path, suite_file: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    argv = ["run", "--suite", str(suite_file), "--topo", "tp2", "--cache-dir", str(cache)]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    for tensors in (cache / "runs").glob("*/tensors.safetensors"):
        tensors.write_bytes(b"\x00" * 64)  # a bad disk, a killed copy
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "failed its checksum (tensors.safetensors); launching again" in out, out


def test_the_reference_topology_as_a_cell_reads_the_reference_run(tmp_path: Path, suite_file: Path, cache_dir: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """tp1 is the reference's own job on the same engine (the gsm8k suite lists it): its cell is checked
    against the reference run instead of launching the same run again; tp2 still runs."""
    assert main(["run", "--suite", str(suite_file), "--topo", "tp1,tp2", "--out", str(tmp_path),
                 "--cache-dir", str(cache_dir)]) == 0
    cells = {c["topology"]: c for c in _results(tmp_path)["cells"]}
    assert cells["tp1"]["status"] == "PASS" and cells["tp1"]["run_dir"] == cells["tp1"]["reference_dir"]
    assert Path(cells["tp1"]["run_dir"]).parent == cache_dir / "runs"
    assert cells["tp2"]["status"] == "PASS" and Path(cells["tp2"]["run_dir"]).is_relative_to(tmp_path / "runs")
    assert [p.name for p in (tmp_path / "runs" / "tiny-gqa").iterdir()] == ["tp2"]  # nothing launched for tp1
    out = capsys.readouterr().out
    assert "tp1: the reference's own job on the same engine" in out
    assert "tiny-gqa/tp1/seed0: PASS (the reference run)" in out
