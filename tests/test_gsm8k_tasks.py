"""lm-eval's own GSM8K tasks, loaded offline from the local jsonl copy, without the default task index."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.errors import ConfigError
from harness.gsm8k.data import ENV_VAR, GSM8KSource, resolve_source
from harness.gsm8k.records import FILTERS
from harness.gsm8k.tasks import (GSM8K_TASK_DIR, build_task, task_config, task_manager, unsupported_variants,
                                 variants)


@pytest.fixture(scope="module")
def source() -> GSM8KSource:
    if not os.environ.get(ENV_VAR):
        pytest.skip(f"{ENV_VAR} is not set (no local GSM8K copy)")
    return resolve_source()


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
    assert len(task.test_docs()) == 1319
    assert len(task.training_docs()) == 7473
    assert task.get_config("num_fewshot") == 5
    assert [f["name"] for f in task.config.filter_list] == list(FILTERS)


def test_num_fewshot_override(source: GSM8KSource) -> None:
    task = build_task("gsm8k_cot", source, num_fewshot=2)["tasks"]["gsm8k_cot"]
    assert task.get_config("num_fewshot") == 2


def test_zero_shot_variant_refuses_shots(source: GSM8KSource) -> None:
    with pytest.raises(ConfigError, match="zero-shot by definition"):
        build_task("gsm8k_cot_zeroshot", source, num_fewshot=3)


def test_fewshot_context_is_reproducible(source: GSM8KSource) -> None:
    def first_prompt() -> str:
        task = build_task("gsm8k", source)["tasks"]["gsm8k"]
        doc = task.test_docs()[0]
        return str(task.fewshot_context(doc, num_fewshot=5))
    assert first_prompt() == first_prompt()
