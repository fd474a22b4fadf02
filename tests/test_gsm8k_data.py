"""GSM8K source resolution: explicit path, environment variable, hub, offline refusal, folder checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.gsm8k.data import ENV_VAR, HUB_CONFIG, HUB_DATASET, GSM8KSource, resolve_source, validate_folder

ROW = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


def _folder(tmp_path: Path, test_rows: list[object] | None = None, train_rows: list[object] | None = None) -> Path:
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split, rows in (("test", test_rows), ("train", train_rows)):
        lines = [json.dumps(r) for r in (rows if rows is not None else [ROW, ROW])]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_explicit_path_wins_over_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "elsewhere"))
    source = resolve_source(folder)
    assert source.is_local and source.folder == folder.resolve()
    assert source.task_overrides() == {
        "dataset_path": "json", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(folder.resolve() / "test.jsonl"),
                                          "train": str(folder.resolve() / "train.jsonl")}}}


def test_environment_variable_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _folder(tmp_path)
    monkeypatch.setenv(ENV_VAR, str(folder))
    assert resolve_source().folder == folder.resolve()


def test_bad_environment_folder_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=f"{ENV_VAR}=.*does not exist"):
        resolve_source()


def test_offline_without_local_copy_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError) as info:
        resolve_source()
    message = str(info.value)
    assert "HF_DATASETS_OFFLINE" in message and "--gsm8k-path" in message and ENV_VAR in message
    assert "test.jsonl" in message and "train.jsonl" in message


def test_online_without_local_copy_uses_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    source = resolve_source()
    assert not source.is_local
    assert source.task_overrides()["dataset_path"] == HUB_DATASET
    assert source.task_overrides()["dataset_name"] == HUB_CONFIG
    assert os.environ.get("HF_DATASETS_OFFLINE") is None  # resolution itself never goes online


def test_missing_split_file(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "train.jsonl").unlink()
    with pytest.raises(ConfigError, match="lacks train.jsonl"):
        validate_folder(folder)


@pytest.mark.parametrize(("rows", "message"), [
    ([{"answer": "x"}], "line 1: missing string field 'question'"),
    ([ROW, {"question": "q"}], "line 2: missing string field 'answer'"),
    ([[1, 2]], "line 1: expected a JSON object"),
    ([], "holds no questions"),
])
def test_bad_lines_are_named(tmp_path: Path, rows: list[object], message: str) -> None:
    folder = _folder(tmp_path, test_rows=rows)
    with pytest.raises(ConfigError, match=message):
        validate_folder(folder)


def test_invalid_json_line(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "test.jsonl").write_text(json.dumps(ROW) + "\n{broken\n")
    with pytest.raises(ConfigError, match="test.jsonl line 2: not valid JSON"):
        validate_folder(folder)


def test_hub_source_has_no_local_files() -> None:
    with pytest.raises(ConfigError, match="hub"):
        GSM8KSource(folder=None).split_file("test")


def test_shared_copy_validates() -> None:
    path = os.environ.get(ENV_VAR)
    if not path:
        pytest.skip(f"{ENV_VAR} is not set (no shared GSM8K copy)")
    assert validate_folder(Path(path)).is_dir()
