"""Test setup: no hub access, ever; GSM8K from the shared folder when present."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
if "HARNESS_GSM8K_PATH" not in os.environ and (_SHARED_GSM8K / "test.jsonl").is_file():
    os.environ["HARNESS_GSM8K_PATH"] = str(_SHARED_GSM8K)


import pytest  # noqa: E402

from harness.artifacts import RunArtifacts, read_run  # noqa: E402

TEST_PROMPTS = ["The capital of France is", "def f(x):\n    return", "Q: 17 + 25 = ?\nA:"]


def launch_run(out_dir: Path, model: str, topo: str, fault: str | None = None, prompts: list[str] | None = None,
               dtype: str | None = None, env: dict[str, str] | None = None, timeout_s: float = 300.0,
               collective_timeout_s: float = 60.0) -> RunArtifacts:
    """Launch one real run (torchrun on gloo for world size > 1) and read its run directory."""
    from harness.engine.worker import Job
    from harness.launch import launch
    from harness.specs.model import load_model
    from harness.specs.topology import parse_topology_name

    topology = parse_topology_name(topo)
    job = Job(model=load_model(model).to_dict(), topology=topology.to_dict(), prompts=prompts or TEST_PROMPTS,
              out_dir=str(out_dir), fault=fault, dtype=dtype, max_new_tokens=12, decode_prefix_tokens=3,
              pool={"budget_bytes": 8 << 20, "max_seq_len": 256}, collective_timeout_s=collective_timeout_s)
    launch(job, timeout_s, env=env)
    return read_run(out_dir)


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str | None], RunArtifacts]:
    return {}


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory, run_cache: dict) -> object:  # type: ignore[type-arg]
    """run(model, topo, fault=None) -> RunArtifacts, launched once per test session (and xdist worker)."""
    def _run(model: str, topo: str, fault: str | None = None) -> RunArtifacts:
        key = (model, topo, fault)
        if key not in run_cache:
            run_cache[key] = launch_run(tmp_path_factory.mktemp(f"{model}-{topo}-{fault}"), model, topo, fault)
        return run_cache[key]
    return _run
