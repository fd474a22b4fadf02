"""The sampling workload over HTTP: `harness run --suite tp --topo tp2 --engine harness-serve --workload sampling`
sends the sampling settings and per-request seeds to a real `harness serve`, whose draws the sampling checks judge
(the distribution by a two-sample test against the reference server's own draws). A clean cell PASSes (negative
control); a sampler fault behind the server FAILs sampling_distribution while the logits agree (positive control);
sampling_ranks SKIPs saying why (a server answers rank 0's draws only). The reference runs once per module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.cli import main
from harness.records.results import results_cells

pytestmark = pytest.mark.xdist_group("http-sampling")  # the module's reference runs once


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http-sampling-cache")


def _run(out: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict[str, Any]]]:
    code = main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--engine", "harness-serve",
                 "--workload", "sampling", "--out", str(out), "--cache-dir", str(cache), *extra])
    (cell,) = results_cells(out)
    return code, {ch["name"]: ch for ch in cell["checks"]}


@pytest.mark.slow
def test_a_clean_sampled_cell_passes_over_http_and_a_sampler_fault_fails(tmp_path: Path, cache: Path) -> None:
    code, checks = _run(tmp_path / "clean", cache)
    assert code == 0, {n: ch["reason"] for n, ch in checks.items() if ch["verdict"] not in ("PASS", "SKIP")}
    dist = checks["sampling_distribution"]
    assert dist["verdict"] == "PASS" and "two-sample" in dist["reason"], dist
    assert dist["metrics"]["tests"] == 4 * 8 and dist["metrics"]["draws_per_position"] == 400  # prefill path only
    assert checks["sampling_seeded"]["verdict"] == "PASS", checks["sampling_seeded"]
    ranks = checks["sampling_ranks"]
    assert ranks["verdict"] == "SKIP" and "gives no rank_draws" in ranks["reason"], ranks
    code, checks = _run(tmp_path / "fault", cache, "--fault", "sample-topk-per-shard")
    assert code != 0 and checks["sampling_distribution"]["verdict"] == "FAIL", checks["sampling_distribution"]
    assert checks["logits_prefill"]["verdict"] == "PASS"  # the logits agree: the sampler is the suspect
    assert checks["logits_decode"]["verdict"] != "FAIL", checks["logits_decode"]  # draws are not held to a top-k


@pytest.mark.slow
def test_an_engine_without_per_request_seeds_samples_unseeded(tmp_path: Path, cache: Path) -> None:
    """A template with seeded_sampling: false (vLLM's CPU build: a seeded request crashes its worker): the sampled
    requests go without seeds, the two-sample test still PASSes on the independent draws, and sampling_seeded is a
    SKIP naming the capability the engine lacks (never a FAIL of a reproducibility the engine does not offer)."""
    template = tmp_path / "unseeded.yaml"
    template.write_text("extends: harness-serve\nseeded_sampling: false\n")
    code = main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--engine", str(template),
                 "--workload", "sampling", "--out", str(tmp_path / "out"), "--cache-dir", str(cache)])
    (cell,) = results_cells(tmp_path / "out")
    checks = {ch["name"]: ch for ch in cell["checks"]}
    assert code == 0 and checks["sampling_distribution"]["verdict"] == "PASS", checks["sampling_distribution"]
    seeded = checks["sampling_seeded"]
    assert seeded["verdict"] == "SKIP" and "gives no seeded_sampling" in seeded["reason"], seeded
