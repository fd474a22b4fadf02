"""The run contract's Job: every field typed, one serialization (to_dict / from_dict, to_json / from_json),
and a job.json an earlier harness wrote (partial pool, raw request schedule) reading as the job it means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.backends.replay import ReplayBackend
from harness.core.errors import ConfigError
from harness.core.jsonio import write_json
from harness.formats.locate import load_model
from harness.records.contract import JOB_FILE, MANIFEST_FILE, GSM8KJob, Job
from harness.specs.pool import PoolSettings
from harness.specs.send_schedule import SendSchedule
from harness.specs.speculative import SpeculativeSettings
from harness.specs.suite import read_suite
from harness.specs.topology import parse_topology_name


def _job(**kw: object) -> Job:
    workloads = read_suite("dcp").resolved_workloads(None)[:2]
    base: dict[str, object] = dict(
        model=load_model("tiny-gqa"), topology=parse_topology_name("tp2-mtp"), prompts=["a", "b"], out_dir="run",
        fault="dcp-lse-merge", dtype="float32", seed=3, pool=PoolSettings(budget_bytes=8 << 20, max_seq_len=256),
        gsm8k=GSM8KJob({"task": "gsm8k", "limit": 3}, "data/gsm8k.jsonl"),
        speculative=SpeculativeSettings(k=2, draft_noise=0.2), request_schedule=SendSchedule.parse("staggered:wave=2"),
        workloads=workloads)
    base.update(kw)
    return Job(**base)  # type: ignore[arg-type]


def test_every_field_round_trips_typed_through_json() -> None:
    job = _job()
    back = Job.from_json(job.to_json())
    assert back == job
    assert isinstance(back.pool, PoolSettings) and isinstance(back.speculative, SpeculativeSettings)
    assert isinstance(back.gsm8k, GSM8KJob) and isinstance(back.request_schedule, SendSchedule)
    assert back.prompts == ("a", "b") and len(back.workloads) == 2 and back.workloads[0].name == job.workloads[0].name
    plain = Job(model=load_model("tiny-gqa"), topology=parse_topology_name("tp1"), prompts=["x"], out_dir="r")
    data = plain.to_dict()
    assert data["speculative"] == {} and data["gsm8k"] is None and data["request_schedule"] is None
    assert data["pool"] == PoolSettings().to_dict() and Job.from_dict(data) == plain


def test_an_earlier_job_json_reads_and_replays_as_the_job_it_means(tmp_path: Path) -> None:
    """A job.json with a partial pool, an empty speculative mapping and a string request schedule (as the
    harness wrote them before the Job was typed) is the same job: replay still finds its run."""
    job = _job(speculative=None, gsm8k=None, workloads=(), topology=parse_topology_name("tp2"),
               pool=PoolSettings(budget_bytes=8 << 20, max_seq_len=256, block_size=16),
               request_schedule=SendSchedule.parse("one-at-a-time"))
    old = {**job.to_dict(), "pool": {"budget_bytes": 8 << 20, "max_seq_len": 256}, "speculative": {},
           "request_schedule": "one-at-a-time", "out_dir": "elsewhere"}
    assert Job.from_dict(old) == Job.from_dict({**job.to_dict(), "out_dir": "elsewhere"})
    run = tmp_path / "stored" / "run"
    run.mkdir(parents=True)
    (run / JOB_FILE).write_text(json.dumps(old))
    write_json(run / MANIFEST_FILE, {"status": "ok"})
    assert ReplayBackend(str(tmp_path / "stored")).find(job) == run
    assert ReplayBackend(str(tmp_path / "stored")).find(_job(seed=4, speculative=None, gsm8k=None, workloads=(),
                                                             topology=parse_topology_name("tp2"))) is None


@pytest.mark.parametrize(("change", "message"), [
    ({"pool": {"budget_bytes": 0}}, "budget_bytes=0 must be >= 1"),
    ({"pool": {"budget": 5}}, "unknown key 'budget'"),
    ({"speculative": {"k": 0}}, "k must be a positive integer"),
    ({"request_schedule": "burst"}, "request schedule 'burst' is not one of"),
    ({"schedule": "random"}, "job schedule 'random'"),
    ({"priority": 1}, "unknown key 'priority'"),
])
def test_a_bad_job_json_is_one_error_naming_the_value(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Job.from_dict({**_job().to_dict(), **change})
