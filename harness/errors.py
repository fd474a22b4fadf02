"""The harness's exceptions. Only the CLI turns them into exit codes."""


class HarnessError(Exception):
    """Base class of every error the harness raises on purpose."""


class ConfigError(HarnessError):
    """Bad input: a spec, a flag or a combination that cannot run. CLI exit code 2."""


class RunError(HarnessError):
    """A run that started but broke (crashed or hung rank, missing artifact)."""
