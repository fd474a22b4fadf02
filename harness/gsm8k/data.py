"""Where GSM8K comes from: a local folder of jsonl files, or the Hugging Face hub when online.

Resolution order: an explicit path (``--gsm8k-path``), then the environment variable
HARNESS_GSM8K_PATH, then the hub dataset ``openai/gsm8k`` (config ``main``). An offline run
(HF_DATASETS_OFFLINE or HF_HUB_OFFLINE set) never falls back to the hub: it fails with a message
saying how to point at a local folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError

ENV_VAR = "HARNESS_GSM8K_PATH"
HUB_DATASET = "openai/gsm8k"
HUB_CONFIG = "main"
SPLITS: tuple[str, ...] = ("test", "train")
FIELDS: tuple[str, ...] = ("question", "answer")
OFFLINE_VARS: tuple[str, ...] = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


@dataclass(frozen=True)
class GSM8KSource:
    """A resolved GSM8K source: a validated local folder, or the hub (folder is None)."""

    folder: Path | None

    @property
    def is_local(self) -> bool:
        return self.folder is not None

    def split_file(self, split: str) -> Path:
        if self.folder is None:
            raise ConfigError(f"GSM8K comes from the hub ({HUB_DATASET}); there is no local {split}.jsonl")
        return self.folder / f"{split}.jsonl"

    def task_overrides(self) -> dict[str, Any]:
        """The lm-eval TaskConfig keys that select this source (everything else stays lm-eval's)."""
        if self.folder is None:
            return {"dataset_path": HUB_DATASET, "dataset_name": HUB_CONFIG, "dataset_kwargs": None}
        files = {split: str(self.split_file(split)) for split in SPLITS}
        return {"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": files}}

    def describe(self) -> str:
        return str(self.folder) if self.folder is not None else f"hub:{HUB_DATASET}/{HUB_CONFIG}"


def offline_flag() -> str | None:
    """The name of the environment variable that makes this process offline, or None."""
    for name in OFFLINE_VARS:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def validate_folder(folder: Path) -> Path:
    """Check that `folder` holds test.jsonl and train.jsonl with a question and an answer on every line."""
    if not folder.is_dir():
        raise ConfigError(f"GSM8K folder {folder} does not exist or is not a folder; it must hold "
                          f"{' and '.join(f'{s}.jsonl' for s in SPLITS)}")
    missing = [f"{s}.jsonl" for s in SPLITS if not (folder / f"{s}.jsonl").is_file()]
    if missing:
        raise ConfigError(f"GSM8K folder {folder} lacks {', '.join(missing)} (expected the jsonl files of "
                          f"{HUB_DATASET}, config {HUB_CONFIG}: one {{\"question\", \"answer\"}} object per line)")
    for split in SPLITS:
        _validate_jsonl(folder / f"{split}.jsonl")
    return folder.resolve()


def _validate_jsonl(path: Path) -> None:
    count = 0
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ConfigError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            for name in FIELDS:
                if not isinstance(row.get(name), str):
                    raise ConfigError(f"{path} line {lineno}: missing string field {name!r} "
                                      f"(keys: {', '.join(sorted(row)) or 'none'})")
            count += 1
    if count == 0:
        raise ConfigError(f"{path} holds no questions")


def resolve_source(path: str | Path | None = None) -> GSM8KSource:
    """The GSM8K source: `path`, else $HARNESS_GSM8K_PATH, else the hub (refused when offline)."""
    if path is not None and str(path) != "":
        return GSM8KSource(folder=validate_folder(Path(path).expanduser()))
    env = os.environ.get(ENV_VAR, "")
    if env:
        try:
            return GSM8KSource(folder=validate_folder(Path(env).expanduser()))
        except ConfigError as exc:
            raise ConfigError(f"{ENV_VAR}={env}: {exc}") from exc
    flag = offline_flag()
    if flag:
        raise ConfigError(f"GSM8K: {flag} is set and no local copy was given; pass --gsm8k-path DIR or set "
                          f"{ENV_VAR}=DIR, where DIR holds test.jsonl and train.jsonl of {HUB_DATASET} "
                          f"(config {HUB_CONFIG}), one {{\"question\", \"answer\"}} object per line")
    return GSM8KSource(folder=None)
