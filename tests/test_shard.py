"""--shard K/N: a deterministic, cost-balanced split; two shards merged equal the single run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.records.shard import Shard, assign, cell_cost, parse_shard, select


def test_parse_shard_accepts_k_of_n() -> None:
    assert parse_shard("1/4") == Shard(1, 4)
    assert parse_shard(" 3 / 3 ") == Shard(3, 3)


@pytest.mark.parametrize("text", ["0/2", "3/2", "1/0", "2", "a/b", "1/-2", ""])
def test_parse_shard_rejects_bad_values(text: str) -> None:
    with pytest.raises(ConfigError, match="--shard"):
        parse_shard(text)


def test_assign_is_a_partition_balanced_by_cost() -> None:
    costs = [cell_cost(w, s, False) for w, s in [(8, False), (4, False), (4, True), (2, False), (2, False), (1, False)]]
    costs.append(cell_cost(4, False, True))  # a skip costs nothing
    for n in range(1, 6):
        owner = assign(costs, n)
        shares = [[i for i, o in enumerate(owner) if o == s] for s in range(n)]
        assert sorted(i for share in shares for i in share) == list(range(len(costs)))
        loads = [sum(costs[i] for i in share) for share in shares]
        # LPT bound: no share exceeds the ideal by more than the largest item
        assert max(loads) <= sum(costs) / n + max(costs)
        assert assign(costs, n) == owner  # deterministic
    two = assign(costs, 2)
    loads = [sum(c for c, o in zip(costs, two) if o == s) for s in range(2)]
    assert abs(loads[0] - loads[1]) <= min(c for c in costs if c > 0)


def test_select_keeps_plan_order_and_every_item_once() -> None:
    items = list("abcdefg")
    costs = [5.0, 1.0, 3.0, 3.0, 0.0, 2.0, 8.0]
    picked = [select(items, costs, Shard(k, 3)) for k in (1, 2, 3)]
    assert sorted(x for p in picked for x in p) == items
    for p in picked:
        assert p == sorted(p, key=items.index)


def test_bad_shard_is_one_error_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--suite", "dcp", "--topo", "tp2", "--model", "tiny-gqa", "--shard", "3/2",
                 "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == 2
    assert "--shard '3/2'" in err and err.count("harness: error") == 1
    assert not (tmp_path / "o").exists()


def _without_commands(metrics: Any) -> Any:
    """A check's metrics without the commands that name the run's own folder (reference_baseline's update and
    accept commands): like wall times and paths, they differ between a run and its shards."""
    if not isinstance(metrics, dict):
        return metrics
    return {k: v for k, v in metrics.items() if not k.endswith("_command")}


def _comparable(results: Path) -> dict[tuple[Any, ...], Any]:
    """Cells keyed by identity, without wall times, paths and run ids."""
    doc = json.loads(results.read_text())
    out = {}
    for cell in doc["cells"]:
        key = (cell["suite"], cell["model"], cell["topology"], cell["fault"], cell["seed"])
        out[key] = {"status": cell["status"], "silent_corruption": cell["silent_corruption"],
                    "localization": cell["localization"],
                    "checks": [(c["name"], c["verdict"], c["reason"], _without_commands(c["metrics"]))
                               for c in cell["checks"]]}
    return out


def test_two_shards_merged_equal_the_single_run(tmp_path: Path, shared_cache: Path) -> None:
    cache = str(shared_cache)
    base = ["run", "--suite", "dcp", "--topo", "tp2,tp2dcp2", "--model", "tiny-gqa", "--workload", "prompts",
            "--cache-dir", cache]
    assert main([*base, "--out", str(tmp_path / "single")]) == 0
    assert main([*base, "--shard", "1/2", "--out", str(tmp_path / "s1")]) == 0
    assert main([*base, "--shard", "2/2", "--out", str(tmp_path / "s2")]) == 0
    s1, s2 = (_comparable(tmp_path / d / "results.json") for d in ("s1", "s2"))
    assert len(s1) == len(s2) == 1 and set(s1) != set(s2)
    assert json.loads((tmp_path / "s1" / "results.json").read_text())["provenance"]["shard"] == "1/2"
    assert main(["report", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "merged")]) == 0
    merged = _comparable(tmp_path / "merged" / "results.json")
    assert merged == _comparable(tmp_path / "single" / "results.json")
    assert len(merged) == 2
