"""The engine loop of `harness serve`: rank 0 takes batches of requests from the HTTP server's inbox
and broadcasts each to every rank through ParallelState; all ranks execute it in lockstep.

While idle, rank 0 broadcasts a heartbeat every HEARTBEAT_S so that the followers' pending collective
never reaches the process-group timeout.

Abandoned requests (the client went away: its handler cancelled the request's future) are dropped: a
queued one never runs, and a running one leaves the batch at the next engine step. Only rank 0 sees the
clients, so it decides: once per step the executor asks `abandoned()`, which on every rank returns rank
0's answer (one small all-reduce in which the other ranks add zeros), and every rank drops the same
sequences at the same step.
"""

from __future__ import annotations

import queue
import traceback
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.engine.runtime.parallel import ParallelState
from harness.serve.protocol import Completion, CompletionResult

HEARTBEAT_S = 5.0
MAX_BATCH = 64

Abandoned = Callable[[], frozenset[int]]  # indices of the running batch's completions abandoned so far
Executor = Callable[[list[Completion], Abandoned], list[CompletionResult]]


@dataclass
class Pending:
    """One HTTP request's completions and the future its handler awaits; the handler cancels the future
    when its client goes away."""

    completions: list[Completion]
    future: "Future[list[CompletionResult]]" = field(default_factory=Future)

    @property
    def abandoned(self) -> bool:
        return self.future.cancelled()

    def settle(self, results: list[CompletionResult] | None = None, error: BaseException | None = None) -> None:
        """Complete the future, unless its client cancelled it meanwhile."""
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(results or [])
        except InvalidStateError:  # cancelled by its handler: nobody waits for it
            pass


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
        self.comm = state.collectives()

    def _agree(self, flags: list[bool]) -> frozenset[int]:
        """The indices rank 0 flags, on every rank (the others pass all False)."""
        if self.state.distributed and flags:
            summed = self.comm.reduce_tp(torch.tensor(flags, dtype=torch.float32, device=self.state.device))
            flags = [bool(f) for f in summed.tolist()]
        return frozenset(i for i, f in enumerate(flags) if f)

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
                        p.settle(error=RuntimeError("server is shutting down"))
                self._broadcast((STOP, []))
                return
            pending = [p for p in batch if p is not None and not p.abandoned]  # queued, then abandoned: never run
            if not pending:
                self._broadcast((IDLE, []))
                continue
            completions = [c for p in pending for c in p.completions]
            owners = [p for p in pending for _ in p.completions]
            self._broadcast((RUN, completions))
            try:
                results = self.execute(completions, lambda: self._agree([p.abandoned for p in owners]))
            except Exception as exc:  # a bug in the engine: the client gets a 500, the server keeps going
                traceback.print_exc()
                for p in pending:
                    p.settle(error=exc)
                continue
            start = 0
            for p in pending:
                p.settle(results[start:start + len(p.completions)])
                start += len(p.completions)

    def follow(self) -> None:
        """Ranks > 0: execute what rank 0 broadcasts until it says stop."""
        while True:
            kind, completions = self._broadcast(None)
            if kind == STOP:
                return
            if kind == RUN:
                try:
                    self.execute(completions, lambda: self._agree([False] * len(completions)))
                except Exception:
                    traceback.print_exc()
