"""lm-eval's own GSM8K tasks, loaded offline from the local jsonl copy, without the default task index."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.gsm8k.data import ENV_VAR, GSM8KSource, resolve_source
from harness.gsm8k.records import FILTERS
from harness.gsm8k.tasks import GSM8K_TASK_DIR, build_task, task_config, task_manager, unsupported_variants, variants


@pytest.fixture(scope="module")
def source() -> GSM8KSource:
    """The GSM8K folder of the tests (tests/conftest.py: the full set when given, else the fixture)."""
    assert os.environ.get(ENV_VAR)
    return resolve_source()


def _questions(source: GSM8KSource, split: str) -> list[str]:
    lines = source.split_file(split).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()]


def test_task_manager_indexes_only_the_gsm8k_folder() -> None:
    manager = task_manager()
    assert "gsm8k" in manager.all_subtasks
    assert all(name.startswith("gsm8k") for name in manager.all_subtasks)
    assert "hellaswag" not in manager.all_tasks
    assert all(Path(manager.task_index[t].yaml_path).parent == GSM8K_TASK_DIR for t in manager.all_subtasks)


def test_variants_are_lm_evals_greedy_ones() -> None:
    assert {"gsm8k", "gsm8k_cot", "gsm8k_cot_zeroshot", "gsm8k_cot_llama"} <= set(variants())
    assert "gsm8k_cot_self_consistency" in unsupported_variants()


def test_only_the_data_source_is_overridden(source: GSM8KSource) -> None:
    raw = dict(task_manager().task_index["gsm8k"].cfg or {})
    cfg = task_config("gsm8k", source)
    changed = {k for k in set(raw) | set(cfg) if raw.get(k) != cfg.get(k)}
    assert changed <= {"dataset_path", "dataset_name", "dataset_kwargs"}
    assert cfg["dataset_path"] == "json"
    assert [f["name"] for f in cfg["filter_list"]] == list(FILTERS)


def test_unknown_variant_suggests_a_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'gsm8k_cot'"):
        task_config("gsm8k_cott", GSM8KSource(folder=None))


def test_sampling_variant_is_refused() -> None:
    with pytest.raises(ConfigError, match="decodes greedily"):
        task_config("gsm8k_cot_self_consistency", GSM8KSource(folder=None))


def test_local_test_set_loads_offline(source: GSM8KSource) -> None:
    loaded = build_task("gsm8k", source)
    task = loaded["tasks"]["gsm8k"]
    assert [d["question"] for d in task.test_docs()] == _questions(source, "test")
    assert [d["question"] for d in task.training_docs()] == _questions(source, "train")
    assert task.get_config("num_fewshot") == 5
    assert [f["name"] for f in task.config.filter_list] == list(FILTERS)


def test_num_fewshot_override(source: GSM8KSource) -> None:
    task = build_task("gsm8k_cot", source, num_fewshot=2)["tasks"]["gsm8k_cot"]
    assert task.get_config("num_fewshot") == 2


def test_zero_shot_variant_refuses_shots(source: GSM8KSource) -> None:
    with pytest.raises(ConfigError, match="zero-shot by definition"):
        build_task("gsm8k_cot_zeroshot", source, num_fewshot=3)


def test_full_test_set_loads_offline(full_gsm8k: Path) -> None:
    task = build_task("gsm8k", resolve_source(str(full_gsm8k)))["tasks"]["gsm8k"]
    assert len(task.test_docs()) == 1319 and len(task.training_docs()) == 7473


def _shots(source: GSM8KSource, seed: int) -> list[str]:
    """The training questions lm-eval puts in front of the first test question, in order."""
    task = build_task("gsm8k", source, num_fewshot=3, fewshot_seed=seed)["tasks"]["gsm8k"]
    context = str(task.fewshot_context(task.test_docs()[0], num_fewshot=3))
    train = _questions(source, "train")
    return sorted((q for q in train if q in context), key=context.index)


def test_fewshot_examples_follow_the_seed(source: GSM8KSource) -> None:
    """Two separately built tasks with one seed draw the same training examples; another seed draws
    others (so the equality is the seed's doing, not a cached object)."""
    first, again, other = _shots(source, 1234), _shots(source, 1234), _shots(source, 7)
    assert len(first) == 3 and first == again
    assert other != first
