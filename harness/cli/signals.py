"""SIGINT and SIGTERM during a run: the first one raises Interrupted where the run is (a launch then
stops every process group it started, see harness/launcher/launch.py); later ones are ignored while the run
writes what finished."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from types import FrameType
from typing import Any, Iterator

from harness.core.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM raise Interrupted once; the previous handlers come back after."""
    raised: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if raised:  # cleaning up after the first one: let it finish
            return
        raised.append(signum)
        raise Interrupted(signum, signal.Signals(signum).name)

    previous: dict[int, Any] = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_status(exc: Interrupted) -> int:
    """The shell's convention for a process ended by a signal: 128 + signum (130 SIGINT, 143 SIGTERM)."""
    return 128 + exc.signum
