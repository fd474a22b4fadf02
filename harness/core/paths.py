"""Where the shipped suites, topologies and models live, and the per-user cache."""

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.core.errors import ConfigError

PROJECT_ROOT: Path = Path(__file__).resolve().parents[2]
SUITES_DIR: Path = PROJECT_ROOT / "suites"
TOPOLOGIES_DIR: Path = PROJECT_ROOT / "topologies"
MODELS_DIR: Path = PROJECT_ROOT / "models"
BASELINES_DIR: Path = PROJECT_ROOT / "baselines"
REPORTS_DIR: Path = Path("reports")
CACHE_NAME = "llm-parallel-harness"  # the cache's folder under the user's cache home


def default_cache_dir() -> Path:
    """The reference cache and converted checkpoints: $HARNESS_CACHE_DIR as given, else the user's own
    $XDG_CACHE_HOME/llm-parallel-harness (an absolute XDG_CACHE_HOME), else ~/.cache/llm-parallel-harness.
    The per-user folder is created private (mode 0700, an existing one of this user is made so) and
    refused with a ConfigError when another user owns it."""
    given = os.environ.get("HARNESS_CACHE_DIR")
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    home = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: a relative value is ignored
    return private_dir(home / CACHE_NAME)


@contextmanager
def cache_dir_given(folder: Path | None) -> Iterator[None]:
    """While it lasts, `folder` (a --cache-dir) is the cache of everything default_cache_dir() places (the
    reference cache, HTTP engines' HF exports, converted GGUF checkpoints), in this process and the ones it
    starts: HARNESS_CACHE_DIR is set to it, and put back as it was after. None: the cache stays as it is."""
    if folder is None:
        yield
        return
    before = os.environ.get("HARNESS_CACHE_DIR")
    os.environ["HARNESS_CACHE_DIR"] = str(Path(folder).resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HARNESS_CACHE_DIR", None)
        else:
            os.environ["HARNESS_CACHE_DIR"] = before


def private_dir(path: Path) -> Path:
    """`path`, created with mode 0700 if missing; a ConfigError naming it when it is not a folder of this user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise ConfigError(f"cache folder {path}: cannot create it ({exc.strerror}); "
                          f"set HARNESS_CACHE_DIR or --cache-dir to a folder of your own") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"cache folder {path} is not a folder; set HARNESS_CACHE_DIR or --cache-dir")
    if info.st_uid != os.getuid():
        raise ConfigError(f"cache folder {path} belongs to another user (uid {info.st_uid}, you are uid "
                          f"{os.getuid()}): a reference cache is never shared by accident; set HARNESS_CACHE_DIR "
                          f"or --cache-dir to a folder of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path
