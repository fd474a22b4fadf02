"""Where the shipped suites, topologies and models live."""

from pathlib import Path

PROJECT_ROOT: Path = Path(__file__).resolve().parent.parent
SUITES_DIR: Path = PROJECT_ROOT / "suites"
TOPOLOGIES_DIR: Path = PROJECT_ROOT / "topologies"
MODELS_DIR: Path = PROJECT_ROOT / "models"
BASELINES_DIR: Path = PROJECT_ROOT / "baselines"
REPORTS_DIR: Path = Path("reports")
