"""The deploy/ templates run on this box by simulation: the variables each scheduler sets, real processes side by
side. A nightly of two suites x two seeds split over 4 Slurm array tasks, 4 Kubernetes Indexed Job pods and a
GitHub Actions matrix of 4 reproduces the single-machine verdicts cell for cell, and each reference and noise run
is computed once (by the references phase; the cells phase only reads them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SUITES, SEEDS, TOPO, ARGS = "dcp tp", "0 1", "tp2", "--model tiny-gqa --workload prompts"
SHARES = 4

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("nightly-deploy")]


def _env(folder: Path, **more: str) -> dict[str, str]:
    """The environment of one phase: the nightly's settings, this interpreter's harness, and the scheduler's."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION", "BUILDKITE_"))}
    return {**keep, "HARNESS_NIGHTLY_DIR": str(folder), "HARNESS_SUITES": SUITES, "HARNESS_SEEDS": SEEDS,
            "HARNESS_TOPO": TOPO, "HARNESS_RUN_ARGS": ARGS, "HARNESS_CMD": f"{sys.executable} -m harness",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **more}


def _side_by_side(argv: list[str], envs: list[dict[str, str]], logs: Path, name: str) -> list[str]:
    """`argv` started once per environment, all at once (one per machine of the scheduler); their outputs."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for k, env in enumerate(envs):
        out = open(logs / f"{name}-{k}.log", "wb")
        procs.append((subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    texts = []
    for proc, out in procs:
        code = proc.wait(timeout=1200)
        out.close()
        texts.append(Path(out.name).read_text())
        assert code == 0, texts[-1][-3000:]
    return texts


def _verdicts(report: Path) -> dict[tuple[Any, ...], tuple[str, tuple[tuple[str, str], ...]]]:
    doc = json.loads((report / "results.json").read_text())
    return {(c["suite"], c["model"], c["topology"], c["seed"], c["workload"]):
            (c["status"], tuple((k["name"], k["verdict"]) for k in c["checks"])) for c in doc["cells"]}


def _references(folder: Path) -> set[str]:
    return {json.loads(line)["reference"] for f in (folder / "cells").glob("*.jsonl")
            for line in f.read_text().splitlines() if json.loads(line)["reference"]}


def _launched(texts: list[str]) -> list[str]:
    """The reference-side runs launched (not read from the cache) in these outputs."""
    return [m for t in texts for m in re.findall(r"^\s+((?:reference|noise) .*): running$", t, flags=re.M)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, shared_cache: Path) -> dict[tuple[Any, ...], Any]:
    """The same nightly on one machine: every suite in one process each, merged."""
    root = tmp_path_factory.mktemp("single")
    seeds = [w for s in SEEDS.split() for w in ("--seed", s)]
    dirs = []
    for suite in SUITES.split():
        dirs.append(root / suite)
        assert main(["run", "--suite", suite, "--topo", TOPO, *seeds, *ARGS.split(), "--out", str(dirs[-1]),
                     "--cache-dir", str(shared_cache)]) == 0
    assert main(["report", *map(str, dirs), "--out", str(root / "report")]) == 0
    return _verdicts(root / "report")


def _nightly(folder: Path, run_phase: Any) -> tuple[list[str], list[str]]:
    """plan here, then `run_phase(phase)` for references and cells (side by side), then merge here;
    (the references phase's outputs, the cells phase's)."""
    subprocess.run(["bash", "deploy/nightly.sh", "plan"], cwd=ROOT, env=_env(folder), check=True)
    refs = run_phase("references")
    cells = run_phase("cells")
    subprocess.run(["bash", "deploy/nightly.sh", "merge"], cwd=ROOT, env=_env(folder), check=True)
    return refs, cells


def _check(folder: Path, refs: list[str], cells: list[str], single: dict[tuple[Any, ...], Any],
           suites: str = SUITES) -> None:
    assert _verdicts(folder / "report") == {k: v for k, v in single.items() if k[0] in suites.split()}
    launched = _launched(refs)
    n_suites = len(suites.split())
    assert len(launched) == 2 * len(_references(folder)) == 2 * n_suites * 2  # (ref + noise) x suites x seeds
    assert len(set(launched)) == len(launched) // n_suites  # labels repeat across suites only (their prompts differ)
    assert _launched(cells) == [] and not any("another harness process is launching" in t for t in refs + cells)


def test_slurm_array(tmp_path: Path, single: dict[tuple[Any, ...], Any]) -> None:
    def phase(name: str) -> list[str]:
        envs = [_env(tmp_path, SLURM_ARRAY_TASK_ID=str(k), SLURM_ARRAY_TASK_MIN="0",
                     SLURM_ARRAY_TASK_COUNT=str(SHARES), SLURM_ARRAY_JOB_ID="77", HARNESS_REPO=str(ROOT))
                for k in range(SHARES)]
        return _side_by_side(["bash", str(DEPLOY / "slurm" / "nightly.sbatch"), name], envs, tmp_path / "logs", name)

    refs, cells = _nightly(tmp_path, phase)
    _check(tmp_path, refs, cells, single)
    # 2 launches per suite over 4 tasks, balanced: every launch on a task of its own, the other tasks idle
    assert len(list((tmp_path / "shards").glob("*/share-*/results.json"))) == 2 * 2


def test_kubernetes_indexed_job(tmp_path: Path, single: dict[tuple[Any, ...], Any]) -> None:
    doc = yaml.safe_load((DEPLOY / "k8s" / "indexed-job.yaml").read_text())
    spec = doc["spec"]
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert spec["completionMode"] == "Indexed" and spec["completions"] == int(env["HARNESS_SHARD_COUNT"])
    assert spec["parallelism"] == spec["completions"]

    def phase(name: str) -> list[str]:
        argv = [w.replace("PHASE", name) for w in container["command"]]
        envs = [_env(tmp_path, HARNESS_SHARD_COUNT=env["HARNESS_SHARD_COUNT"], JOB_COMPLETION_INDEX=str(k))
                for k in range(spec["completions"])]
        return _side_by_side(argv, envs, tmp_path / "logs", name)

    refs, cells = _nightly(tmp_path, phase)
    _check(tmp_path, refs, cells, single)


def test_github_actions_matrix(tmp_path: Path, single: dict[tuple[Any, ...], Any]) -> None:
    doc = yaml.safe_load((DEPLOY / "github" / "nightly.yml").read_text())
    jobs = doc["jobs"]
    assert jobs["references"]["needs"] == "plan" and jobs["cells"]["needs"] == "references"
    shards = jobs["cells"]["strategy"]["matrix"]["shard"]
    assert shards == list(range(1, int(doc["env"]["SHARES"]) + 1))

    def runs(job: str, **matrix: str) -> list[str]:
        out = []
        for step in jobs[job]["steps"]:
            text = step.get("run", "")
            if "deploy/nightly.sh" in text:
                out.append(re.sub(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", lambda m: matrix[m.group(1)], text))
        return out

    def run_job(job: str, envs: list[dict[str, str]], each: list[dict[str, str]]) -> list[str]:
        texts = []
        for line in runs(job, **each[0]) if len(each) == 1 else [None]:
            if line is not None:
                texts += _side_by_side(["bash", "-c", line], envs, tmp_path / "logs", job)
            else:  # one matrix job per shard, side by side
                argv = [["bash", "-c", runs(job, **m)[0]] for m in each]
                for a, env in zip(argv, envs):
                    env["HARNESS_STEP"] = a[2]
                texts += _side_by_side(["bash", "-c", 'eval "$HARNESS_STEP"'], envs, tmp_path / "logs", job)
        return texts

    env = _env(tmp_path, SHARES=doc["env"]["SHARES"], HARNESS_SUITES="dcp")  # one suite: the other tests run two
    run_job("plan", [env], [{}])
    refs = run_job("references", [dict(env)], [{}])
    cells = run_job("cells", [dict(env) for _ in shards], [{"shard": str(s)} for s in shards])
    merge = runs("merge")
    assert merge[0].startswith("deploy/nightly.sh merge") and merge[1] == "deploy/nightly.sh rerun"
    subprocess.run(["bash", "deploy/nightly.sh", "merge"], cwd=ROOT, env=env, check=True)
    _check(tmp_path, refs, cells, single, suites="dcp")


def test_reference_cache_under_concurrent_writers(tmp_path: Path) -> None:
    """Three processes asking one fresh cache for the same references at once: each run is launched by one of them,
    the others wait for its entry; every entry is complete (its checksums hold) and no staging folder is left."""
    from harness.flow.refcache import checksum_problem

    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "harness", "run", "--suite", "dcp", "--topo", "tp2", "--seed", "0", *ARGS.split(),
            "--references-only", "--cache-dir", str(cache)]
    texts = _side_by_side(argv, [dict(os.environ, HF_HUB_OFFLINE="1")] * 3, tmp_path / "logs", "writer")
    launched = _launched(texts)
    assert sorted(launched) == ["noise tiny-gqa tp1 float32 seed 0", "reference tiny-gqa tp1 float32 seed 0"]
    assert all(t.count("references: 1 ready") == 1 for t in texts)
    entries = sorted((cache / "runs").iterdir())
    assert len(entries) == 2 and all(checksum_problem(e) is None for e in entries)


def test_slurm_multinode_cell_takes_its_rendezvous_from_the_allocation(tmp_path: Path, shared_cache: Path) -> None:
    """deploy/slurm/multinode.sbatch as srun starts it on each of 2 nodes (SLURM_NODEID 0 and 1 of SLURM_NNODES=2,
    node 0 the first host of SLURM_JOB_NODELIST): one command for both, `--nnodes env`; tp4dcp2 as 2 nodes x 2
    ranks gives the single-node run's verdicts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    more = dict(HARNESS_SUITES="dcp", HARNESS_SUITE="dcp", HARNESS_TOPO="tp4dcp2", HARNESS_SEEDS="0",
                HARNESS_GPUS="4")
    subprocess.run(["bash", "deploy/nightly.sh", "plan"], cwd=ROOT, env=_env(tmp_path, **more), check=True)
    envs = [_env(tmp_path, **more, HARNESS_IN_SRUN="1", SLURM_NODEID=str(k), SLURM_NNODES="2",
                 SLURM_JOB_NODELIST="localhost", HARNESS_RDZV_PORT=str(port), HARNESS_REPO=str(ROOT))
            for k in range(2)]
    _side_by_side(["bash", str(DEPLOY / "slurm" / "multinode.sbatch")], envs, tmp_path / "logs", "node")
    out = tmp_path / "shards" / "dcp" / "multinode-node0"
    assert json.loads((out / "results.json").read_text())["provenance"]["nnodes"] == 2
    assert not (tmp_path / "shards" / "dcp" / "multinode-node1" / "results.json").exists()
    single = tmp_path / "single"
    assert main(["run", "--suite", "dcp", "--topo", "tp4dcp2", "--seed", "0", *ARGS.split(), "--out", str(single),
                 "--cache-dir", str(shared_cache)]) == 0
    assert _verdicts(out) == _verdicts(single)
