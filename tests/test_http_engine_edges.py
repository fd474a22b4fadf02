"""What an HTTP engine run is given and where it keeps things: `{cpu_bind}` follows the process's CPU affinity,
the shipped vLLM template is given the harness's KV budget (so the layout check compares capacity), and
`--cache-dir` holds the HF exports an HTTP engine needs, with the scheduling-noise twin named as noise in the
progress lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.backends.http.backend import HttpBackend
from harness.formats.locate import load_model
from harness.records.contract import Job
from harness.specs.engine import load_engine
from harness.specs.pool import PoolSettings
from harness.specs.topology import parse_topology_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity calls and at least 2 allowed CPUs")
def test_cpu_bind_honours_the_process_cpu_affinity() -> None:
    """A process pinned to its last allowed CPU (taskset, a container's cpuset) binds every rank there, not to
    CPUs 0..n-1 of the machine."""
    last = max(os.sched_getaffinity(0))
    code = ("import os, sys; os.sched_setaffinity(0, {%d}); from harness.backends.http.backend import cpu_bind; "
            "print(cpu_bind(1), cpu_bind(2))" % last)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    assert out == [str(last), f"{last}|{last}"]


def test_cpu_bind_splits_the_allowed_cpus_by_id() -> None:
    from harness.backends.http.backend import cpu_bind
    assert cpu_bind(2, [2, 3, 6, 7]) == "2-3|6-7" and cpu_bind(3, [1, 2, 3, 4, 5, 6, 7]) == "1-2|3-4|5-7"


def test_the_vllm_template_is_given_the_kv_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-cache-memory-bytes {kv_budget_mib}M: vLLM sizes its cache from the harness's budget per rank, exactly
    (M is 2^20 to vLLM), so the layout check compares its allocation with the planner's for that budget."""
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)
    spec = load_engine("vllm")
    assert spec.gets_kv_budget() and "VLLM_CPU_KVCACHE_SPACE" not in spec.env  # that one would override it
    job = Job(model=load_model("tiny-hd64"), topology=parse_topology_name("tp2"), prompts=["hi"], out_dir="run",
              pool=PoolSettings(budget_bytes=8 << 20, max_seq_len=256))
    argv, _ = HttpBackend("vllm").command(job, "/model", 8000)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "8M"


@pytest.mark.slow
def test_cache_dir_holds_the_http_exports_and_the_noise_twin_is_labelled(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """An engine that loads HF folders gets the synthetic model exported once, into --cache-dir's exports/ (not the
    user's default cache); the scheduling-noise twin's progress line says it is the noise run."""
    from harness.cli import main

    template = yaml.safe_load((ROOT / "engines" / "harness-serve.yaml").read_text())
    template["model_format"] = "hf"  # {model_path} is an HF folder: harness serve loads it back
    template["argv"] += ["--served-model-name", "{model_name}"]
    path = tmp_path / "serve-hf.yaml"
    path.write_text(yaml.safe_dump(template))
    default, cache = tmp_path / "default-cache", tmp_path / "cache"
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(default))
    assert main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--engine", str(path), "--out",
                 str(tmp_path / "out"), "--cache-dir", str(cache), "--kv-budget-mib", "8", "--max-seq-len", "128",
                 "--workload", "prompts"]) == 0
    assert [p.name.startswith("tiny-gqa-") for p in (cache / "exports").iterdir()] == [True]
    assert not (default / "exports").exists()
    assert os.environ["HARNESS_CACHE_DIR"] == str(default)  # put back after the run
    out = capsys.readouterr().out
    assert out.count("reference tiny-gqa tp1 float32 seed 0 (serve-hf): running") == 1, out
    assert "noise tiny-gqa tp1 float32 seed 0 (serve-hf), cases sent one at a time: running" in out, out


def test_the_export_cache_is_keyed_by_the_exporters_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An HF export is reused only by the same exporter code: a copy of the package with the same sources keys the
    same folder, one whose exporter (harness.formats.export or a module it imports) changed keys another."""
    import shutil

    from harness.backends.http.backend import export_dir

    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    model = load_model("tiny-gqa")
    same, changed = tmp_path / "same", tmp_path / "changed"
    for root in (same, changed):
        shutil.copytree(ROOT / "harness", root / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    checkpoint = changed / "harness" / "formats" / "hf" / "write.py"  # imported by the exporter, not its entry module
    checkpoint.write_text(checkpoint.read_text() + "\n# another writer\n")
    assert export_dir(model, same) == export_dir(model)
    assert export_dir(model, changed).parent == export_dir(model).parent
    assert export_dir(model, changed) != export_dir(model)
    assert export_dir(load_model("tiny-hd64"), same) != export_dir(model, same)  # the spec keys it too
