"""The engine loop of `harness serve`: rank 0 takes batches of requests from the HTTP server's inbox
and broadcasts each to every rank through ParallelState; all ranks execute it in lockstep.

While idle, rank 0 broadcasts a heartbeat every HEARTBEAT_S so that the followers' pending collective
never reaches the process-group timeout.
"""

from __future__ import annotations

import queue
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from harness.engine.parallel import ParallelState
from harness.serve.protocol import Completion, CompletionResult

HEARTBEAT_S = 5.0
MAX_BATCH = 64

Executor = Callable[[list[Completion]], list[CompletionResult]]


@dataclass
class Pending:
    """One HTTP request's completions and the future its handler awaits."""

    completions: list[Completion]
    future: "Future[list[CompletionResult]]" = field(default_factory=Future)


STOP = "stop"
RUN = "run"
IDLE = "idle"


class Lockstep:
    def __init__(self, state: ParallelState, execute: Executor) -> None:
        self.state = state
        self.execute = execute
        # SimpleQueue: its put() is reentrant, so stop() may run in a signal handler that interrupted the
        # leader inside inbox.get() (a Queue's lock would deadlock there, and the server never stop)
        self.inbox: "queue.SimpleQueue[Pending | None]" = queue.SimpleQueue()

    def _broadcast(self, command: tuple[str, list[Completion]] | None) -> tuple[str, list[Completion]]:
        """Rank 0's `command` on every rank (the others pass None)."""
        return self.state.gather_objects(command)[0]  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Ask the leader loop to end (safe from any thread or a signal handler)."""
        self.inbox.put(None)

    def _take_batch(self) -> list[Pending | None]:
        """The next request (waiting up to HEARTBEAT_S) and every request already queued behind it."""
        try:
            batch: list[Pending | None] = [self.inbox.get(timeout=HEARTBEAT_S)]
        except queue.Empty:
            return []
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        return batch

    def lead(self) -> None:
        """Rank 0: serve the inbox until stop()."""
        while True:
            batch = self._take_batch()
            if None in batch:
                for p in batch:
                    if p is not None:
                        p.future.set_exception(RuntimeError("server is shutting down"))
                self._broadcast((STOP, []))
                return
            if not batch:
                self._broadcast((IDLE, []))
                continue
            pending = [p for p in batch if p is not None]
            completions = [c for p in pending for c in p.completions]
            self._broadcast((RUN, completions))
            try:
                results = self.execute(completions)
            except Exception as exc:  # a bug in the engine: the client gets a 500, the server keeps going
                traceback.print_exc()
                for p in pending:
                    p.future.set_exception(exc)
                continue
            start = 0
            for p in pending:
                p.future.set_result(results[start:start + len(p.completions)])
                start += len(p.completions)

    def follow(self) -> None:
        """Ranks > 0: execute what rank 0 broadcasts until it says stop."""
        while True:
            kind, completions = self._broadcast(None)
            if kind == STOP:
                return
            if kind == RUN:
                try:
                    self.execute(completions)
                except Exception:
                    traceback.print_exc()
