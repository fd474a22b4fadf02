"""Time limits of a launch, in one place (the CLI, the runner and the worker read them from here)."""

LAUNCH_TIMEOUT_S: float = 900.0       # a launch still running after this is killed (ERROR cell)
COLLECTIVE_TIMEOUT_S: float = 120.0   # a collective waiting this long fails: a hung peer ends the launch
