"""The harness's exceptions. Only the CLI turns them into exit codes."""


class HarnessError(Exception):
    """Base class of every error the harness raises on purpose."""


class ConfigError(HarnessError):
    """Bad input: a spec, a flag or a combination that cannot run. CLI exit code 2."""


class RunError(HarnessError):
    """A run that started but broke (crashed or hung rank, missing artifact)."""


class DiskFull(RunError):
    """The disk of a run's folder filled up during the matrix: the runner stops; the cells done are kept."""

    def __init__(self, folder: object, free: int, cell: str) -> None:
        super().__init__(f"no space left on device in {folder} ({free} bytes free) while running cell {cell}; "
                         f"free some space or give --out / --cache-dir on a larger disk")
        self.folder = folder
        self.free = free


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived during a run (a BaseException, so no `except Exception` swallows it).
    The CLI exits 128 + signum after writing what finished."""

    def __init__(self, signum: int, name: str) -> None:
        super().__init__(f"interrupted by {name}")
        self.signum = signum
        self.name = name
