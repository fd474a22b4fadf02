"""Recorded reference baselines: the record and its comparison within rounding (unit), and end to end on real
runs: a clean rerun on a fresh cache and another seed PASS, a fault the tp1 reference shares FAILs as "the reference
changed since build X", an intended change is accepted with a reason and shown in the sign-off."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save

from harness.baselines.reference_baseline import CHANGED, references_path
from harness.baselines.reference_record import (
    UNIT_ROUNDOFF,
    RoundingBound,
    _draw_counts,
    compare_records,
    record_of,
)
from harness.cli import main
from harness.records.artifacts import read_run

BOUND = RoundingBound("float32", 2, 256)


def _record(t: int = 6, k: int = 5, layers: int = 3) -> dict[str, torch.Tensor]:
    """A record of one case (index 0): prefill top-k, a greedy generation with clear top-1 margins, summaries."""
    gen = torch.Generator().manual_seed(0)
    lp = -torch.sort(torch.rand(t, k, generator=gen) * 4 + 0.1, dim=-1).values  # [t, k] descending, <= -0.1
    lp[:, 0] = -0.05
    ids = torch.arange(k, dtype=torch.int32).repeat(t, 1) + 10 * torch.arange(t, dtype=torch.int32)[:, None]
    return {"prefill_ids.0": ids, "prefill_logprobs.0": lp.float(), "prefill_scale.0": torch.full((t,), 10.0),
            "gen_tokens.0": ids[:, 0].clone(), "gen_ids.0": ids.clone(), "gen_logprobs.0": lp.float().clone(),
            "gen_scale.0": torch.full((t,), 10.0),
            "layer_norm.0": torch.ones(layers, 2) * 8.0, "layer_proj.0": torch.ones(layers, 2, 4)}


def _copy(rec: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in rec.items()}


def test_the_bound_is_the_dtypes_rounding_times_the_stated_growth() -> None:
    assert UNIT_ROUNDOFF["float32"] == 2.0 ** -24 and UNIT_ROUNDOFF["bfloat16"] == 2.0 ** -8
    assert BOUND.growth == pytest.approx(4 * (2 + 2) * 16)
    assert float(BOUND.logprob(torch.tensor(10.0))) == pytest.approx(2.0 ** -24 * 256 * 10)
    assert RoundingBound("bfloat16", 2, 256).layer(1) > BOUND.layer(1) * 1000


def test_identical_and_within_rounding_pass() -> None:
    old = _record()
    assert compare_records(old, _copy(old), BOUND, [0]).difference is None
    new = _copy(old)
    new["prefill_logprobs.0"] += 1e-5  # well inside 2^-24 x 256 x 10 = 1.5e-4
    found = compare_records(old, new, BOUND, [0])
    assert found.difference is None and found.max_error == pytest.approx(1e-5, rel=0.1)


def test_a_logprob_change_beyond_rounding_is_localized_to_case_position_and_layer() -> None:
    old = _record()
    new = _copy(old)
    new["prefill_logprobs.0"][3, 1] -= 0.01
    new["layer_norm.0"][2:, :] *= 1.01  # the stream first leaves its recording after layer 2
    diff = compare_records(old, new, BOUND, [0]).difference
    assert diff is not None and (diff.case, diff.what, diff.position, diff.layer) == (0, "prefill logprobs", 3, 2)
    assert "logprob" in diff.text() and "first differing layer 2" in diff.text()


def test_a_greedy_divergence_is_benign_only_at_a_recorded_near_tie() -> None:
    old = _record()
    new = _copy(old)
    new["gen_tokens.0"][4] = 999  # recorded top-1/top-2 gap is > 0.05: no tie
    diff = compare_records(old, new, BOUND, [0]).difference
    assert diff is not None and (diff.what, diff.position) == ("greedy tokens", 4)
    old["gen_logprobs.0"][4, 1] = old["gen_logprobs.0"][4, 0] - 1e-6  # a tie within rounding
    tied = _copy(old)
    tied["gen_tokens.0"][4] = 999
    tied["gen_tokens.0"][5] = 998  # after the benign divergence the continuation is another one
    found = compare_records(old, tied, BOUND, [0])
    assert found.difference is None and found.near_ties == 1


def _sampled(probs: torch.Tensor, seed: int, positions: int = 6, draws: int = 400) -> dict[str, torch.Tensor]:
    """A record's draws of one case: `draws` per position from `probs` [positions, V] (or one row for all)."""
    rows = probs.expand(positions, -1) if probs.dim() == 1 else probs
    drawn = torch.multinomial(rows, draws, replacement=True, generator=torch.Generator().manual_seed(seed))
    ids, counts = _draw_counts(drawn)  # [positions, m]
    return {"sample_prefill_ids.0": ids, "sample_prefill_counts.0": counts}


def test_sampled_draws_are_held_to_the_recorded_ones_by_a_two_sample_test() -> None:
    """Another sample of the same distribution (an unseeded engine) passes; a position whose distribution moved
    (two tokens' probabilities swapped) is the first difference; a recording without draws compares none, and
    draws recorded but missing now are a difference."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    old = {**_record(), **_sampled(probs, seed=1)}
    again = compare_records(old, {**_record(), **_sampled(probs, seed=2)}, BOUND, [0])
    assert again.difference is None and again.compared > 6
    moved = probs.repeat(6, 1)
    moved[4] = torch.tensor([0.3, 0.5, 0.15, 0.05])
    found = compare_records(old, {**_record(), **_sampled(moved, seed=2)}, BOUND, [0]).difference
    assert found is not None and (found.what, found.position) == ("sampled draws (prefill path)", 4), found
    assert "two-sample p = " in found.detail and "/ 6 positions" in found.detail
    assert compare_records(_record(), {**_record(), **_sampled(probs, seed=2)}, BOUND, [0]).difference is None
    missing = compare_records(old, _record(), BOUND, [0]).difference
    assert missing is not None and "draws recorded, none now" in missing.detail


def test_a_token_entering_the_top_k_beyond_rounding_fails() -> None:
    old = _record()
    new = _copy(old)
    new["prefill_ids.0"][2, 4] = 777  # another token at the k-th place, far above the recorded cut-off
    new["prefill_logprobs.0"][2, 4] = old["prefill_logprobs.0"][2, 3] - 1e-3
    diff = compare_records(old, new, BOUND, [0]).difference
    assert diff is not None and diff.position == 2 and "777" in diff.detail


SUITE = """
name: refbase
version: 1
models: [tiny-gqa]
topologies: [tp2-draft]
reference: tp1
seeds: [0, 1]
max_new_tokens: 8
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is", "Q: 17 + 25 = ?\\nA:"]
speculative: {k: 3, draft_noise: 0.1}
checks: {layout: {}, logits: {}, generation: {}, acceptance: {}}
"""


def _run(tmp: Path, out: str, cache: str, folder: Path, *extra: str) -> dict[tuple[int, str | None], Any]:
    """`harness run` of the suite; the reference_baseline result of each cell by (seed, fault)."""
    main(["run", "--suite", str(tmp / "refbase.yaml"), "--out", str(tmp / out), "--cache-dir", str(tmp / cache),
          "--baselines-dir", str(folder), *extra])
    cells = json.loads((tmp / out / "results.json").read_text())["cells"]
    return {(c["seed"], c["fault"]): next(k for k in c["checks"] if k["name"] == "reference_baseline")
            for c in cells}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(folder, baselines folder) after a clean run of seeds 0 and 1 and `harness baseline update` from it."""
    tmp = tmp_path_factory.mktemp("refbase")
    (tmp / "refbase.yaml").write_text(SUITE)
    folder = tmp / "baselines"
    before = _run(tmp, "clean", "cache", folder)
    assert all(r["verdict"] == "SKIP" and "harness baseline update" in r["reason"] for r in before.values())
    assert main(["baseline", "update", "--from", str(tmp / "clean"), "--dir", str(folder), "--yes"]) == 0
    return tmp, folder


@pytest.mark.xdist_group("refbase")
def test_update_records_one_compact_reference_per_seed(recorded: tuple[Path, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    tmp, folder = recorded
    index = yaml.safe_load(references_path(folder).read_text())["baselines"]
    assert len(index) == 2 and {e["topology"] for e in index} == {"tp1-draft"}
    assert len({e["weights_hash"] for e in index}) == 2  # a seed reseeds the synthetic weights: another reference
    for entry in index:
        path = folder / entry["record"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        assert entry["bytes"] == path.stat().st_size < 16_000  # two cases, compact
        assert {"prefill_logprobs.0", "decode_ids.1", "gen_tokens.0", "spec_accepted.1", "spec_drafts.0",
                "layer_proj.0"} <= set(load_file(str(path)))
    capsys.readouterr()
    assert main(["baseline", "update", "--from", str(tmp / "clean"), "--dir", str(folder)]) == 0
    assert "up to date" in capsys.readouterr().out  # the same run again: nothing changes


@pytest.mark.xdist_group("refbase")
def test_a_clean_rerun_on_a_fresh_cache_and_either_seed_pass(recorded: tuple[Path, Path]) -> None:
    tmp, folder = recorded
    results = _run(tmp, "rerun", "cache-fresh", folder)
    assert [r["verdict"] for r in results.values()] == ["PASS", "PASS"]
    assert all("matches its recording" in r["reason"] for r in results.values())
    # the sign-off compares a candidate run made before anything was recorded (its cells SKIP) now
    assert main(["signoff", "--candidate", str(tmp / "clean"), "--baseline", str(tmp / "rerun"), "--out",
                 str(tmp / "so-clean"), "--baselines-dir", str(folder)]) == 0
    assert "reference_baseline" not in (tmp / "so-clean" / "signoff.md").read_text().split("## Skipped")[1]
    changed = tmp / "baselines-changed"
    shutil.copytree(folder, changed)
    seed0 = read_run(next(r for r in sorted((tmp / "cache" / "runs").iterdir()) if "tp1-draft-float32-" in r.name))
    _shift_recorded_prefill(changed, seed0.manifest["weights_hash"])
    assert main(["signoff", "--candidate", str(tmp / "clean"), "--baseline", str(tmp / "rerun"), "--out",
                 str(tmp / "so-changed"), "--baselines-dir", str(changed)]) == 1
    (row,) = json.loads((tmp / "so-changed" / "signoff.json").read_text())["references"]
    assert row["verdict"] == "FAIL" and row["reason"].startswith(CHANGED)


@pytest.mark.xdist_group("refbase")
def test_the_reduction_order_noise_run_is_within_the_rounding_bound(recorded: tuple[Path, Path]) -> None:
    """Another build's rounding: the noise run (the reference topology, another reduction order) against the
    reference's record (the speculator's outputs aside: the noise run has none)."""
    tmp, _ = recorded
    runs = sorted((tmp / "cache" / "runs").iterdir())
    ref = read_run(next(r for r in runs if "tp1-draft-float32-" in r.name))
    noise = read_run(next(r for r in runs if "noise-reduction-order" in r.name
                          and read_run(r, with_tensors=False).manifest["seed"] == ref.manifest["seed"]))
    plain = {k: v for k, v in record_of(ref).items() if not k.startswith("spec_")}
    found = compare_records(plain, record_of(noise), RoundingBound("float32", 2, 288), [c.index for c in ref.cases])
    assert found.difference is None and 0 < found.max_error < found.bound_at_max


@pytest.mark.xdist_group("refbase")
def test_a_fault_the_reference_shares_fails_as_a_changed_reference(recorded: tuple[Path, Path]) -> None:
    tmp, folder = recorded
    results = _run(tmp, "fault", "cache", folder, "--seed", "0", "--fault", "spec-verify-last-draft")
    found = results[(0, "spec-verify-last-draft")]
    assert found["verdict"] == "FAIL" and found["reason"].startswith(CHANGED)
    assert "draft acceptance" in found["reason"] and "harness baseline accept" in found["reason"]


def _shift_recorded_prefill(folder: Path, weights_hash: str) -> None:
    """The recording as an older build with other numerics left it: a prefill logprob 0.01 nats off."""
    path = references_path(folder)
    data = yaml.safe_load(path.read_text())
    entry = next(e for e in data["baselines"] if e["weights_hash"] == weights_hash)
    record = load_file(str(folder / entry["record"]))
    record["prefill_logprobs.0"][3, 0] += 0.01
    blob = save({k: record[k] for k in sorted(record)})
    digest = hashlib.sha256(blob).hexdigest()
    entry.update(record=f"references/{digest[:16]}.safetensors", sha256=digest, bytes=len(blob))
    (folder / entry["record"]).write_bytes(blob)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.mark.xdist_group("refbase")
def test_an_intended_change_is_refused_by_update_accepted_with_a_reason_and_signed_off(
        recorded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    tmp, shared = recorded
    folder = tmp / "baselines-accept"
    shutil.copytree(shared, folder)
    seed0 = read_run(next(r for r in sorted((tmp / "cache" / "runs").iterdir()) if "tp1-draft-float32-" in r.name))
    weights = seed0.manifest["weights_hash"]
    _shift_recorded_prefill(folder, weights)
    failed = _run(tmp, "changed", "cache", folder, "--seed", str(seed0.manifest["seed"]))
    (found,) = failed.values()
    assert found["verdict"] == "FAIL" and "case 0, prefill logprobs at position 3" in found["reason"]
    capsys.readouterr()
    assert main(["baseline", "update", "--from", str(tmp / "changed"), "--dir", str(folder), "--yes"]) == 1
    assert "refused" in capsys.readouterr().out  # update never takes a changed reference silently
    assert main(["baseline", "accept", "--from", str(tmp / "changed"), "--dir", str(folder), "--yes",
                 "--reason", "new attention kernel"]) == 0
    again = _run(tmp, "accepted", "cache", folder, "--seed", str(seed0.manifest["seed"]))
    (passed,) = again.values()
    assert passed["verdict"] == "PASS" and "new attention kernel" in passed["reason"]
    assert main(["signoff", "--candidate", str(tmp / "accepted"), "--baseline", str(tmp / "changed"), "--out",
                 str(tmp / "signoff"), "--baselines-dir", str(folder)]) == 0
    doc = json.loads((tmp / "signoff" / "signoff.json").read_text())
    assert [r["verdict"] for r in doc["references"]] == ["PASS"]
    assert "new attention kernel" in doc["references"][0]["accepted"]
    assert "new attention kernel" in (tmp / "signoff" / "signoff.md").read_text()
    assert main(["baseline", "accept", "--from", str(tmp / "changed"), "--dir", str(folder),
                 "--reason", " "]) == 2  # a reason is required


HTTP_SUITE = """
name: refhttp
version: 1
models: [tiny-gqa]
topologies: [tp2]
reference: tp1
max_new_tokens: 6
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is"]
checks: {layout: {}, logits: {}, generation: {}}
"""


@pytest.mark.xdist_group("refbase")
def test_an_http_engines_reference_is_recorded_per_engine_version(tmp_path: Path) -> None:
    """`harness serve` (top-k only, no per-layer summaries): recorded under its engine and version; a rerun on a
    fresh cache PASSes against it."""
    (tmp_path / "refhttp.yaml").write_text(HTTP_SUITE)
    folder = tmp_path / "baselines"

    def run(out: str, cache: str) -> dict[str, Any]:
        main(["run", "--suite", str(tmp_path / "refhttp.yaml"), "--engine", "harness-serve", "--out",
              str(tmp_path / out), "--cache-dir", str(tmp_path / cache), "--baselines-dir", str(folder)])
        (cell,) = json.loads((tmp_path / out / "results.json").read_text())["cells"]
        return next(k for k in cell["checks"] if k["name"] == "reference_baseline")  # type: ignore[no-any-return]

    assert run("first", "cache-a")["verdict"] == "SKIP"
    assert main(["baseline", "update", "--from", str(tmp_path / "first"), "--dir", str(folder), "--yes"]) == 0
    (entry,) = yaml.safe_load(references_path(folder).read_text())["baselines"]
    assert entry["engine"] == "harness-serve" and "llm-parallel-harness" in entry["engine_version"]
    assert not any(k.startswith("layer_") for k in load_file(str(folder / entry["record"])))
    again = run("again", "cache-b")
    assert again["verdict"] == "PASS", again["reason"]


HYBRID_SUITE = """
name: refhyb
version: 1
models: [tiny-hybrid]
topologies: [tp1]
reference: tp1
max_new_tokens: 4
decode_prefix_tokens: 2
kv_budget_mib: 8
max_seq_len: 64
prompts: ["The capital of France is", "Q: 17 + 25 = ?\\nA:"]
checks: {logits: {}, generation: {}}
"""


@pytest.mark.xdist_group("refbase")
def test_a_logits_changing_fault_the_reference_shares_fails_at_its_position_and_layer(tmp_path: Path) -> None:
    """state-slot-stale (a recurrent-state slot reused without zeroing, in code tp1 runs too): every parity check
    agrees with the faulty reference; the recording does not. The tp1 cell is the reference run itself."""
    (tmp_path / "refhyb.yaml").write_text(HYBRID_SUITE)
    folder = tmp_path / "baselines"
    argv = ["run", "--suite", str(tmp_path / "refhyb.yaml"), "--cache-dir", str(tmp_path / "cache"),
            "--baselines-dir", str(folder)]
    assert main([*argv, "--out", str(tmp_path / "clean")]) == 0
    assert main(["baseline", "update", "--from", str(tmp_path / "clean"), "--dir", str(folder), "--yes"]) == 0
    assert main([*argv, "--out", str(tmp_path / "fault"), "--fault", "state-slot-stale"]) == 1
    (cell,) = json.loads((tmp_path / "fault" / "results.json").read_text())["cells"]
    verdicts = {c["name"]: c for c in cell["checks"]}
    found = verdicts["reference_baseline"]
    assert found["verdict"] == "FAIL" and found["reason"].startswith(CHANGED)
    assert "decode-path logprobs at position 0" in found["reason"] and "first differing layer 1" in found["reason"]
    assert found["metrics"]["difference"]["layer"] == 1
    assert [n for n, c in verdicts.items() if c["verdict"] == "FAIL"] == ["reference_baseline"]


SAMPLING_SUITE = """
name: refsample
version: 1
models: [tiny-gqa]
topologies: [tp2]
reference: tp1
max_new_tokens: 4
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is"]
workloads: [sampling]
checks: {logits: {}, generation: {}}
"""


@pytest.mark.xdist_group("refbase")
def test_a_references_draws_are_recorded_and_a_changed_sampler_fails(tmp_path: Path) -> None:
    """The sampling workload's reference draws go into the recording; a rerun on a fresh cache PASSes against them
    (compared, not skipped); a recording whose draws came from another sampler (one position's draws moved to
    another token, as an older build with a different sampler would have left them) FAILs at that position."""
    (tmp_path / "refsample.yaml").write_text(SAMPLING_SUITE)
    folder = tmp_path / "baselines"

    def check(out: str, cache: str) -> dict[str, Any]:
        main(["run", "--suite", str(tmp_path / "refsample.yaml"), "--out", str(tmp_path / out), "--cache-dir",
              str(tmp_path / cache), "--baselines-dir", str(folder)])
        (cell,) = json.loads((tmp_path / out / "results.json").read_text())["cells"]
        return next(k for k in cell["checks"] if k["name"] == "reference_baseline")  # type: ignore[no-any-return]

    assert check("first", "cache-a")["verdict"] == "SKIP"
    assert main(["baseline", "update", "--from", str(tmp_path / "first"), "--dir", str(folder), "--yes"]) == 0
    index = references_path(folder)
    data = yaml.safe_load(index.read_text())
    (entry,) = data["baselines"]
    record = load_file(str(folder / entry["record"]))
    draws = sorted(k for k in record if k.startswith("sample_") and k.endswith("_counts." + k.split(".")[-1]))
    assert draws and all(int(record[k].sum()) > 0 for k in draws), sorted(record)
    again = check("again", "cache-b")
    assert again["verdict"] == "PASS", again["reason"]
    assert again["metrics"]["compared"] > sum(record[k].shape[0] for k in draws)  # the draws were compared
    key = draws[0]
    ids = record[key.replace("_counts.", "_ids.")]
    record[key][1] = 0
    record[key][1, 0] = int(record[key][0].sum())  # position 1: every draw on one token
    ids[1, 0] = int(ids[1].max()) + 1               # a token the current sampler never draws there
    blob = save({k: record[k] for k in sorted(record)})
    digest = hashlib.sha256(blob).hexdigest()
    entry.update(record=f"references/{digest[:16]}.safetensors", sha256=digest, bytes=len(blob))
    (folder / entry["record"]).write_bytes(blob)
    index.write_text(yaml.safe_dump(data, sort_keys=False))
    changed = check("changed", "cache-b")
    assert changed["verdict"] == "FAIL" and changed["reason"].startswith(CHANGED), changed["reason"]
    assert "sampled draws" in changed["reason"] and "at position 1" in changed["reason"], changed["reason"]
