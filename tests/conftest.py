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
