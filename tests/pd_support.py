"""What the disaggregated prefill/decode tests share: a small pd suite's YAML, its file and cache folder as
module fixtures, and a harness run's cells with their checks by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

from harness.cli import main
from harness.records.results import results_cells

PD_CHECKS = ("pd_transfer", "pd_load", "pd_consistency")
PROMPTS = ("The capital of France is",
           "Once upon a time, in a land far away, there lived a king who had three daughters and a dog",
           "Q: 17 + 25 = ?\nA:")


def pd_suite(name: str, models: Sequence[str], topologies: Sequence[str], prompts: Sequence[str] = PROMPTS,
             max_new_tokens: int = 6, decode_prefix_tokens: int = 3, extra: str = "",
             checks: str = "{layout: {}, logits: {}, generation: {}}") -> str:
    """A pd suite's YAML (8 MiB KV budget, 256 tokens); `extra`: more top-level lines."""
    lines = [f"name: {name}", "version: 1", f"models: {json.dumps(list(models))}",
             f"topologies: {json.dumps(list(topologies))}", f"max_new_tokens: {max_new_tokens}",
             f"decode_prefix_tokens: {decode_prefix_tokens}", "kv_budget_mib: 8", "max_seq_len: 256", "prompts:",
             *(f"  - {json.dumps(p)}" for p in prompts), f"checks: {checks}"]
    return "\n".join(lines) + "\n" + extra


def suite_fixture(text: str, name: str) -> Callable[..., Path]:
    """A module fixture writing `text` as NAME.yaml once per module."""

    @pytest.fixture(scope="module")
    def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
        path = tmp_path_factory.mktemp("suite") / f"{name}.yaml"
        path.write_text(text)
        return path

    return suite_file


def cache_fixture() -> Callable[..., Path]:
    """A module fixture: one cache folder the module's runs share (references computed once)."""

    @pytest.fixture(scope="module")
    def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp("cache")

    return cache_dir


def run_cells(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    """`harness run --suite SUITE --out OUT --cache-dir CACHE EXTRA...`: its exit code and result cells."""
    code = main(["run", "--suite", str(suite), "--out", str(out), "--cache-dir", str(cache), *extra])
    return code, results_cells(out)


def checks_of(cell: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {ch["name"]: ch for ch in cell["checks"]}
