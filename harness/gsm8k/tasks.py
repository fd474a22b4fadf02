"""lm-eval's own GSM8K task definitions, with only the data source replaced, and their evaluation.

The TaskManager indexes only lm-eval's ``tasks/gsm8k`` folder (``include_defaults=False``): a few
milliseconds instead of the seconds the full default index of every task costs. Each variant's
config (prompt, few-shot, generation kwargs, strict-match and flexible-extract filters, metric) is
lm-eval's YAML as shipped; the harness overrides dataset_path/dataset_name/dataset_kwargs only.
"""

from __future__ import annotations

import time
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import lm_eval
from lm_eval.api.model import LM
from lm_eval.defaults import DEFAULT_OTHER_SEED
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager
from lm_eval.tasks.manager import TaskDict

from harness.core.errors import ConfigError, RunError
from harness.gsm8k.data import GSM8KSource, resolve_source
from harness.gsm8k.records import GSM8KResult, QuestionRecord, final_answer
from harness.specs.loader import did_you_mean

GSM8K_TASK_DIR: Path = Path(lm_eval.__file__).resolve().parent / "tasks" / "gsm8k"
METRIC = "exact_match"
FEWSHOT_SEED: int = DEFAULT_OTHER_SEED  # lm-eval's default: identical few-shot contexts in every run


@lru_cache(maxsize=1)
def task_manager() -> TaskManager:
    """A TaskManager over lm-eval's gsm8k folder only (no default index of every task)."""
    return TaskManager(include_defaults=False, include_path=str(GSM8K_TASK_DIR))


def _raw_config(variant: str) -> dict[str, Any]:
    index = task_manager().task_index
    entry = index.get(variant)
    names = variants() + unsupported_variants()
    if entry is None or entry.cfg is None or variant not in names:
        raise ConfigError(f"unknown GSM8K task variant {variant!r}{did_you_mean(variant, names)}; "
                          f"valid: {', '.join(variants())}")
    return dict(entry.cfg)


def _greedy(cfg: Mapping[str, Any]) -> bool:
    gen = cfg.get("generation_kwargs") or {}
    return not gen.get("do_sample", False) and int(cfg.get("repeats", 1)) == 1


@lru_cache(maxsize=1)
def _all_variants() -> tuple[tuple[str, bool], ...]:
    index = task_manager()
    return tuple((name, _greedy(index.task_index[name].cfg or {})) for name in index.all_subtasks)


def variants() -> tuple[str, ...]:
    """The GSM8K variants the harness can run: lm-eval's greedy ones (gsm8k, gsm8k_cot, ...)."""
    return tuple(name for name, greedy in _all_variants() if greedy)


def unsupported_variants() -> tuple[str, ...]:
    """lm-eval's sampling variants (self-consistency): the harness decodes greedily."""
    return tuple(name for name, greedy in _all_variants() if not greedy)


def task_config(variant: str, source: GSM8KSource) -> dict[str, Any]:
    """lm-eval's config of `variant` with only the dataset keys replaced by `source`'s."""
    cfg = _raw_config(variant)
    if not _greedy(cfg):
        raise ConfigError(f"GSM8K variant {variant!r} samples (do_sample or repeats > 1); the harness decodes "
                          f"greedily; use one of {', '.join(variants())}")
    cfg.update(source.task_overrides())
    return cfg


def build_task(variant: str, source: GSM8KSource | None = None, num_fewshot: int | None = None,
               fewshot_seed: int = FEWSHOT_SEED) -> TaskDict:
    """Load one GSM8K variant as lm-eval's TaskDict ({"tasks": {name: Task}, ...}) ready for `evaluate`.

    `source` defaults to `resolve_source()`; `num_fewshot` None keeps the variant's own count.
    Few-shot examples are drawn with `fewshot_seed`, so every run sees the same prompts.
    """
    cfg = task_config(variant, source if source is not None else resolve_source())
    default_shots = cfg.get("num_fewshot")
    if num_fewshot is not None:
        if num_fewshot < 0:
            raise ConfigError(f"num_fewshot={num_fewshot} must be >= 0")
        if default_shots == 0 and num_fewshot > 0:
            raise ConfigError(f"GSM8K variant {variant!r} is zero-shot by definition; drop num_fewshot={num_fewshot} "
                              f"or pick another variant")
        cfg["num_fewshot"] = num_fewshot
    elif default_shots is None:
        cfg["num_fewshot"] = 0
    try:
        loaded = task_manager().load(cfg)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ConfigError(f"GSM8K variant {variant!r}: lm-eval could not load its data: {exc}") from exc
    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=fewshot_seed)
    return loaded


def evaluate_task(lm: LM, loaded: TaskDict, limit: int | None = None, apply_chat_template: bool = False,
                  fewshot_as_multiturn: bool = False, system_instruction: str | None = None) -> GSM8KResult:
    """Run lm-eval's `evaluate` on one loaded GSM8K task, with per-sample logging, into a GSM8KResult.

    Uses `evaluate` (not `simple_evaluate`): under torchrun every rank gets the result, since the
    harness LM reports rank 0 / world size 1 on all ranks.
    """
    if len(loaded["tasks"]) != 1:
        raise ConfigError(f"expected one GSM8K task, got {', '.join(loaded['tasks'])}")
    (name, task), = loaded["tasks"].items()
    start = time.perf_counter()
    out = evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=True, bootstrap_iters=1000,
                   apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
                   system_instruction=system_instruction)
    wall_s = time.perf_counter() - start
    if out is None:
        raise RunError("lm-eval returned no results (it believes this process is not rank 0)")
    return _result(name, int(task.get_config("num_fewshot") or 0), out, wall_s)


def evaluate_with(lm: LM, variant: str, source: GSM8KSource | None = None, limit: int | None = None,
                  num_fewshot: int | None = None, apply_chat_template: bool = False,
                  fewshot_as_multiturn: bool = False, system_instruction: str | None = None,
                  fewshot_seed: int = FEWSHOT_SEED) -> GSM8KResult:
    """Build `variant` and evaluate `lm` on its first `limit` test questions (all when None)."""
    loaded = build_task(variant, source, num_fewshot, fewshot_seed)
    return evaluate_task(lm, loaded, limit, apply_chat_template, fewshot_as_multiturn, system_instruction)


def _result(name: str, num_fewshot: int, out: Mapping[str, Any], wall_s: float) -> GSM8KResult:
    metrics = out["results"][name]
    scores: dict[str, float] = {}
    stderrs: dict[str, float] = {}
    for key, value in metrics.items():
        metric, _, filter_name = key.partition(",")
        if metric == METRIC and filter_name:
            scores[filter_name] = float(value)
        elif metric == f"{METRIC}_stderr" and filter_name and isinstance(value, (int, float)):
            stderrs[filter_name] = float(value)
    records = records_from_samples(out["samples"][name])
    return GSM8KResult(task=name, num_fewshot=num_fewshot, n=len(records), scores=scores, stderrs=stderrs,
                       records=records, wall_s=wall_s)


def records_from_samples(samples: list[Mapping[str, Any]]) -> tuple[QuestionRecord, ...]:
    """lm-eval's logged samples (one per question and filter) -> one record per question, by index."""
    by_doc: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for sample in samples:
        by_doc[int(sample["doc_id"])].append(sample)
    records = []
    for doc_id in sorted(by_doc):
        rows = by_doc[doc_id]
        first = rows[0]
        target = str(first["target"])
        records.append(QuestionRecord(
            index=doc_id, question=str(first["doc"]["question"]), target=target,
            target_answer=final_answer(target), generation=str(first["resps"][0][0]),
            answers={str(r["filter"]): str(r["filtered_resps"][0]) for r in rows},
            correct={str(r["filter"]): bool(r[METRIC]) for r in rows},
            prompt_hash=str(first["prompt_hash"]), doc_hash=str(first["doc_hash"])))
    return tuple(records)
