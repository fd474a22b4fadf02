"""How an HTTP run sends a job's requests: one request per case, sent as a schedule says, so the server's
batch composition really changes, and when each request left and was answered.

Schedules (SendSchedule, harness/specs/send_schedule.py: a string, `NAME[:key=value,...]`, or the same as a
mapping {"name": NAME, key: value}):
  one-at-a-time   each request after the previous one was answered
  all-at-once     every request at once, at most `max_in_flight` open (default 8)
  staggered       waves of `wave` requests (default 1), each `delay_s` (default 0.05 s) after the previous
                  one was sent, so later requests join a batch the server is already running; at most
                  `max_in_flight` open
Without a schedule (`None`) a run sends as it always did: all cases in one request (or one at a time for
the noise twin). Results come back in case order whatever order the answers arrive in.

The record (`SendLog.to_dict`, the manifest's `requests`): the schedule and, per request, its phase
(`score`: teacher-forced top-k; `generate`: the greedy generation), case, the order it was sent and
answered in, and its send and answer times in seconds since the phase's first send; `max_in_flight_seen`
is the most requests that were open at once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from harness.specs.send_schedule import ONE_AT_A_TIME, STAGGERED, SendSchedule

T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """One request: which, in what order it was sent and answered, and when (seconds since the phase began)."""

    phase: str
    case: int
    sent_order: int
    answered_order: int
    sent_s: float
    answered_s: float


@dataclass
class SendLog:
    """What a run's sender did, phase by phase."""

    schedule: SendSchedule
    requests: list[Timing] = field(default_factory=list)

    def max_in_flight_seen(self, phase: str | None = None) -> int:
        """The most requests of `phase` (any phase: None) open at one time."""
        events = sorted([(t.sent_s, 1) for t in self.requests if phase in (None, t.phase)]
                        + [(t.answered_s, -1) for t in self.requests if phase in (None, t.phase)],
                        key=lambda e: (e[0], e[1]))  # an answer before a send at the same instant
        open_now = most = 0
        for _, step in events:
            open_now += step
            most = max(most, open_now)
        return most

    def to_dict(self) -> dict[str, Any]:
        phases = sorted({t.phase for t in self.requests})
        return {"schedule": self.schedule.to_dict(), "requests": [vars(t) for t in self.requests],
                "max_in_flight_seen": {p: self.max_in_flight_seen(p) for p in phases}}


def send(phase: str, cases: Sequence[int], requests: Sequence[Callable[[], T]], schedule: SendSchedule,
         log: SendLog) -> list[T]:
    """Run `requests` (one per case of `cases`) as `schedule` says; their answers in case order. A request
    that raises stops the sending and the first exception (in case order) is raised once every sent one
    returned."""
    lock = threading.Lock()
    sent: list[int] = []
    answered: list[int] = []
    times: dict[int, tuple[float, float]] = {}
    started = [threading.Event() for _ in requests]
    start = time.perf_counter()

    def timed(i: int) -> T:
        with lock:
            sent.append(i)
        began = time.perf_counter() - start
        started[i].set()
        try:
            return requests[i]()
        finally:
            done = time.perf_counter() - start
            with lock:
                answered.append(i)
                times[i] = (began, done)

    if schedule.name == ONE_AT_A_TIME:
        results = [timed(i) for i in range(len(requests))]
    else:
        with ThreadPoolExecutor(max_workers=schedule.max_in_flight, thread_name_prefix="harness-send") as pool:
            futures: list[Future[T]] = []
            for i in range(len(requests)):
                if schedule.name == STAGGERED and i and i % schedule.wave == 0:  # the last wave has left: wait
                    for f, event in zip(futures[i - schedule.wave:], started[i - schedule.wave:i]):
                        while not event.wait(0.01) and not f.done():
                            pass
                    time.sleep(schedule.delay_s)
                if any(f.done() and f.exception() is not None for f in futures):
                    break
                futures.append(pool.submit(timed, i))
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:  # also when the sending stopped early
            raise failed
        results = [f.result() for f in futures]
    log.requests += [Timing(phase=phase, case=cases[i], sent_order=sent.index(i), answered_order=answered.index(i),
                            sent_s=round(times[i][0], 6), answered_s=round(times[i][1], 6))
                     for i in range(len(requests))]
    return results
