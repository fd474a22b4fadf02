"""Where the shipped suites, topologies and models live, and the per-user cache."""

import os
from pathlib import Path

PROJECT_ROOT: Path = Path(__file__).resolve().parent.parent
SUITES_DIR: Path = PROJECT_ROOT / "suites"
TOPOLOGIES_DIR: Path = PROJECT_ROOT / "topologies"
MODELS_DIR: Path = PROJECT_ROOT / "models"
BASELINES_DIR: Path = PROJECT_ROOT / "baselines"
REPORTS_DIR: Path = Path("reports")


def default_cache_dir() -> Path:
    """The reference cache and converted checkpoints: $HARNESS_CACHE_DIR or ~/.cache/llm-parallel-harness."""
    return Path(os.environ.get("HARNESS_CACHE_DIR", Path.home() / ".cache" / "llm-parallel-harness"))
