"""The HTTP backend sends a job's requests as its request schedule says (harness/backends/http/send.py),
against a real `harness serve` on 127.0.0.1: all at once they overlap (the recorded send and answer
times say so) and the server batches them, one at a time they never do, staggered they leave in waves;
the answers come back in case order and agree with one-at-a-time's. Without a schedule the run sends
as before (one request for all cases) and records none."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from harness.backends.http.backend import HttpBackend
from harness.backends.http.send import SendLog, SendSchedule, send
from harness.core.details import CellDetails
from harness.core.errors import ConfigError
from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.formats.locate import load_model
from harness.records.artifacts import read_run
from harness.records.contract import SCHEDULE_SEQUENTIAL, Job
from harness.report.html import render_html
from harness.specs.topology import parse_topology_name
from tests.test_serve import serving

pytestmark = pytest.mark.xdist_group("http-send")  # one server for the module

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a",
           "Q: 17 + 25 = ?\nA:", "<script>alert('escape me')</script> tokens & more", "Layout bugs hide in decode"]


@pytest.mark.parametrize("text, parsed", [
    ("one-at-a-time", SendSchedule("one-at-a-time")),
    ("all-at-once", SendSchedule("all-at-once", max_in_flight=8)),
    ("all-at-once:max_in_flight=2", SendSchedule("all-at-once", max_in_flight=2)),
    ("staggered:wave=2,delay_s=0.1", SendSchedule("staggered", wave=2, delay_s=0.1)),
    ({"name": "staggered", "wave": 3}, SendSchedule("staggered", wave=3)),
])
def test_schedules_parse(text: Any, parsed: SendSchedule) -> None:
    assert SendSchedule.parse(text) == parsed
    assert SendSchedule.parse(parsed.to_dict()) == parsed


@pytest.mark.parametrize("text, message", [
    ("all-at-twice", "request schedule 'all-at-twice' is not one of one-at-a-time, all-at-once, staggered"),
    ("one-at-a-time:wave=2", r"one-at-a-time: unknown parameter\(s\) wave \(takes: none\)"),
    ("staggered:wave", "parameters are key=value"),
    ("all-at-once:max_in_flight=0", "max_in_flight=0 and wave=1 must be >= 1"),
    ("staggered:delay_s=soon", "must be numbers"),
])
def test_bad_schedules_are_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SendSchedule.parse(text)


def test_a_failing_request_is_raised_and_the_rest_still_answer_in_order() -> None:
    log = SendLog(SendSchedule("all-at-once", max_in_flight=2))

    def boom() -> int:
        raise RuntimeError("request 1 broke")
    with pytest.raises(RuntimeError, match="request 1 broke"):
        send("score", [0, 1, 2], [lambda: 0, boom, lambda: 2], log.schedule, log)
    assert send("score", [5, 6], [lambda: "a", lambda: "b"], log.schedule, log) == ["a", "b"]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpBackend]:
    folder = tmp_path_factory.mktemp("send")
    template = folder / "attached-serve.yaml"  # harness serve, spoken to in vLLM's dialect, attached by URL
    template.write_text("description: harness serve attached by URL\ndialect: vllm\nurl: http://127.0.0.1:1\n"
                        "health: /health\nmax_logprobs: 5\n")
    with serving(folder, "tp2", 256, 8) as server:
        yield HttpBackend(str(template), server.base_url)


@pytest.fixture(scope="module")
def runs(backend: HttpBackend, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("send-runs")
    done = {}
    for name, schedule in (("default", None), ("one", "one-at-a-time"), ("all", "all-at-once:max_in_flight=6"),
                           ("staggered", "staggered:wave=2,delay_s=0.05"), ("noise", "all-at-once")):
        job = Job(model=load_model("tiny-gqa"), topology=parse_topology_name("tp2"), prompts=PROMPTS,
                  out_dir=str(out / name),
                  request_schedule=SendSchedule.parse(schedule) if schedule is not None else None,
                  schedule=SCHEDULE_SEQUENTIAL if name == "noise" else "batched")
        result = backend.run(job, 300.0)
        assert result.ok, result.error
        done[name] = read_run(out / name)
    return done


def _requests(run: Any, phase: str) -> list[dict[str, Any]]:
    return sorted((r for r in run.manifest["requests"]["requests"] if r["phase"] == phase), key=lambda r: r["case"])


@pytest.mark.slow
def test_all_at_once_overlaps_and_answers_as_one_at_a_time_does(runs: dict[str, Any]) -> None:
    together, alone = runs["all"], runs["one"]
    for phase in ("score", "generate"):
        reqs = _requests(together, phase)
        assert len(reqs) == len(PROMPTS)
        # overlap: some request was sent before another one was answered
        assert together.manifest["requests"]["max_in_flight_seen"][phase] > 1
        assert any(a["sent_s"] < b["answered_s"] and b["sent_s"] < a["answered_s"] for a in reqs for b in reqs
                   if a is not b)
        assert alone.manifest["requests"]["max_in_flight_seen"][phase] == 1
        steps = _requests(alone, phase)
        assert [r["sent_order"] for r in steps] == list(range(len(PROMPTS)))
        assert all(a["answered_s"] <= b["sent_s"] for a, b in zip(steps, steps[1:]))
    assert together.manifest["requests"]["schedule"] == {"name": "all-at-once", "max_in_flight": 6}
    for case in together.cases:  # answers in case order, whatever order they arrived in
        for kind in ("gen_tokens", "gen_topk_ids", "prefill_topk_ids"):
            assert torch.equal(together.tensor(kind, case.index), alone.tensor(kind, case.index)), (kind, case.index)
        for kind in ("gen_topk_logprobs", "prefill_topk_logprobs"):
            assert torch.allclose(together.tensor(kind, case.index), alone.tensor(kind, case.index), atol=1e-4)
    assert [c.generated_ids for c in together.cases] == [c.generated_ids for c in runs["default"].cases]


@pytest.mark.slow
def test_staggered_requests_leave_in_waves(runs: dict[str, Any]) -> None:
    reqs = _requests(runs["staggered"], "generate")
    assert [r["sent_order"] for r in reqs] == list(range(len(PROMPTS)))
    waves = [reqs[i:i + 2] for i in range(0, len(reqs), 2)]
    for earlier, later in zip(waves, waves[1:]):  # each wave leaves at least delay_s after the one before
        assert min(r["sent_s"] for r in later) >= max(r["sent_s"] for r in earlier) + 0.05 - 1e-3
    assert runs["staggered"].manifest["requests"]["schedule"] == {"name": "staggered", "max_in_flight": 8,
                                                                 "wave": 2, "delay_s": 0.05}


@pytest.mark.slow
def test_without_a_schedule_and_in_the_noise_twin_nothing_changes(runs: dict[str, Any]) -> None:
    assert "requests" not in runs["default"].manifest  # all cases in one request, as always
    assert "requests" not in runs["noise"].manifest  # the scheduling noise twin still sends one at a time


@pytest.mark.slow
def test_the_report_shows_each_request_of_the_cell(runs: dict[str, Any]) -> None:
    record = runs["all"].manifest["requests"]
    cell = CellResult(suite="s", model="tiny-gqa", topology="tp2", fault=None, seed=0, clean_exit=True,
                      checks=(CheckResult("generation", Verdict.PASS, "6/6 identical"),),
                      details=CellDetails(requests={"parallel": record}).to_dict())
    page = render_html([cell], {}, "r")
    assert "<h4>Requests</h4>" in page and "parallel run: each case" in page
    # how many were open at once depends on the machine's load (the first answer may come before the last send)
    seen = record["max_in_flight_seen"]["generate"]
    assert "schedule.name</th><td>all-at-once" in page and f"most in flight.generate</th><td>{seen}<" in page
    assert page.count("<td>generate</td>") == len(PROMPTS) == page.count("<td>score</td>")


def test_a_workloads_schedule_maps_to_the_sender() -> None:
    # a workload (harness/specs/workload.py) names its schedule and, staggered, the requests joining per step
    assert SendSchedule.from_workload({"schedule": "staggered", "join_per_step": 3, "lengths": [5]}) == SendSchedule(
        "staggered", wave=3)
    assert SendSchedule.from_workload({"schedule": "one-at-a-time", "join_per_step": 1}) == SendSchedule(
        "one-at-a-time")
    with pytest.raises(ConfigError, match="request schedule 'later' is not one of"):
        SendSchedule.from_workload({"schedule": "later"})
