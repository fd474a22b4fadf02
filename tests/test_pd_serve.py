"""Disaggregated prefill/decode over HTTP (`--engine harness-serve`, real servers on loopback): the run starts a
prefill server and a decode server sharing the KV store, sends each case's prompt to the prefill server, then
its generation to the decode server, which loads the KV through the connector. Negative control: clean cells at
two layout pairs pass every check, pd_transfer comparing real rows, and a second seed reuses both servers.
Positive controls: P/D faults FAIL the checks named for them, as on the embedded engine, and an error reported
under a lock is an ERROR naming the hang with the stuck rank's stacks, never a run that waits forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from harness.cli import main
from harness.records.pd_files import damage_store
from harness.records.results import results_cells
from harness.serve.dialects import BadRequest, Limits, Vocabulary, parse_completions
from harness.serve.protocol import KVTransfer
from tests.pd_support import PD_CHECKS, cache_fixture, checks_of, pd_suite, run_cells, suite_fixture

suite_file = suite_fixture(pd_suite("pds", ["tiny-gqa"], ["tp2>tp1", "tp2>tp2"]), "pds")
cache_dir = cache_fixture()
_checks = checks_of


def _run(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, list[dict]]:
    return run_cells(out, suite, cache, "--engine", "harness-serve", *extra)


def _manifests(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").rglob("manifest.json"))
            if ">" in json.loads(p.read_text())["topology"].get("name", "")]


def test_clean_pd_cells_over_http_pass_every_check_and_reuse_their_servers(tmp_path: Path, suite_file: Path,
                                                                           cache_dir: Path) -> None:
    out = tmp_path / "r"
    code, cells = _run(out, suite_file, cache_dir, "--seed", "0", "--seed", "1")
    assert code == 0, [(c["topology"], [ch["reason"] for ch in c["checks"] if ch["verdict"] not in ("PASS", "SKIP")])
                       for c in cells]
    assert {c["topology"] for c in cells} == {"tp2>tp1", "tp2>tp2"} and len(cells) == 4
    for cell in cells:
        checks = _checks(cell)
        for name in (*PD_CHECKS, "logits_prefill", "logits_decode", "generation"):
            assert checks[name]["verdict"] == "PASS", (cell["topology"], name, checks[name]["reason"])
        assert checks["pd_transfer"]["metrics"]["rows_checked"] > 0
        # each prompt's generation loaded its KV, on every decode rank
        assert checks["pd_transfer"]["metrics"]["loads_checked"] == 3 * {"tp2>tp1": 1, "tp2>tp2": 2}[cell["topology"]]
    manifests = _manifests(out)
    assert len(manifests) == 4
    # each topology's prefill and decode servers start once and serve both seeds
    started = {(m["topology"]["name"], role): set() for m in manifests for role in ("prefill", "decode")}
    for m in manifests:
        started[(m["topology"]["name"], "decode")].add(m["server"]["id"])
        started[(m["topology"]["name"], "prefill")].add(m["server"]["prefill"]["id"])
    assert all(len(ids) == 1 for ids in started.values()), started
    assert len({i for ids in started.values() for i in ids}) == 4  # four distinct servers


@pytest.mark.parametrize(("fault", "topo", "failing", "named"), [
    ("pd-head-offset", "tp2>tp1", {"pd_transfer", "logits_decode", "pd_consistency"}, "KV heads"),
    ("pd-decode-unloaded", "tp2>tp2", {"pd_load", "pd_transfer"}, "request 1"),
])
def test_pd_faults_over_http_fail_their_checks(tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str,
                                               topo: str, failing: set[str], named: str) -> None:
    code, cells = _run(tmp_path / "r", suite_file, cache_dir, "--fault", fault, "--topo", topo)
    assert code == 1
    (cell,) = cells
    checks = _checks(cell)
    for name in failing:
        assert checks[name]["verdict"] == "FAIL", (name, checks[name]["reason"])
    assert any(named in checks[name]["reason"] for name in failing & {"pd_transfer", "pd_load"})


def test_error_under_lock_over_http_is_an_error_naming_the_hang(tmp_path: Path, suite_file: Path,
                                                                cache_dir: Path) -> None:
    out = tmp_path / "r"
    _run(out, suite_file, cache_dir, "--fault", "pd-error-under-lock", "--topo", "tp2>tp2")
    (cell,) = results_cells(out)
    assert cell["status"] == "ERROR", cell["status"]
    log = next((out / "runs").rglob("server.log")).read_text()
    assert "KVLoadHangError: the KV load of request 1 (generation)" in log
    assert "_report" in log  # the stuck thread's stack, in the lock's holder


def test_kv_transfer_params_parse_and_bad_ones_are_named() -> None:
    vocab = Vocabulary(encode=lambda s: [1], decode=lambda ids: "")
    limits = Limits(vocab=100, max_model_len=64, max_logprobs=5)
    body = {"prompt": [[1, 2], [3]], "max_tokens": 2, "kv_transfer_params": {"namespace": "run-1", "requests": [4, 7]}}
    assert [c.kv for c in parse_completions(body, vocab, limits)] == [KVTransfer("run-1", 4), KVTransfer("run-1", 7)]
    assert all(c.kv is None for c in parse_completions({"prompt": [1, 2]}, vocab, limits))
    with pytest.raises(BadRequest, match=r"namespace='\.\.' must be a folder name"):
        parse_completions({**body, "kv_transfer_params": {"namespace": "..", "requests": [0, 1]}}, vocab, limits)
    with pytest.raises(BadRequest, match=r"one request index >= 0 per prompt \(2 prompts\)"):
        parse_completions({**body, "kv_transfer_params": {"namespace": "a", "requests": [0]}}, vocab, limits)


def test_serve_refuses_a_disaggregated_topology_without_a_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "tiny-gqa", "--topo", "tp2>tp1", "--port", "0"]) == 2
    assert "serve it as one side, --pd-role prefill or --pd-role decode (got none)" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-gqa", "--topo", "tp2", "--pd-role", "decode", "--port", "0"]) == 2
    assert "--pd-role/--pd-store need a disaggregated topology" in capsys.readouterr().err


def test_store_damage_deletes_cuts_or_rotates_only_the_kv_tensors(tmp_path: Path) -> None:
    k = torch.arange(32, dtype=torch.float32).reshape(4, 2, 4)  # [n, kv, d]
    tokens = torch.arange(4)
    for condition in ("pd-store-missing", "pd-store-truncated", "pd-store-corrupt"):
        store = tmp_path / condition
        (store / "req0").mkdir(parents=True)
        save_file({"k.0": k, "tokens": tokens}, str(store / "req0" / "p0.safetensors"))
        assert damage_store(store, condition) == ["req0/p0.safetensors"]
        path = store / "req0" / "p0.safetensors"
        if condition == "pd-store-missing":
            assert not path.exists()
        elif condition == "pd-store-truncated":
            with pytest.raises(SafetensorError):
                load_file(str(path))
        else:
            got = load_file(str(path))
            assert torch.equal(got["tokens"], tokens)  # only the KV tensors change
            assert torch.equal(got["k.0"].flatten(), k.flatten().roll(-16))  # half its length: other rows' values
    with pytest.raises(ValueError, match="unknown store damage 'pd-store-x'; valid: pd-store-missing"):
        damage_store(tmp_path, "pd-store-x")


def test_the_pd_suites_default_workloads_over_http_run_or_skip_before_any_server(tmp_path: Path) -> None:
    """docs/pd.md's command on the shipped pd suite (one model): its prompts workload goes through the server pair
    and passes with pd_transfer on real rows; concurrent and prefix-cache, which the P/D client cannot send (a
    staggered schedule, a prefix-cache route), are SKIPs naming that, and the run exits 0."""
    code = main(["run", "--suite", "pd", "--engine", "harness-serve", "--topo", "tp2>tp1", "--model", "tiny-gqa",
                 "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "cache")])
    cells = {c["workload"]: c for c in results_cells(tmp_path / "r")}
    assert code == 0 and set(cells) == {"prompts", "concurrent", "prefix-cache"}
    prompts = _checks(cells["prompts"])
    assert cells["prompts"]["status"] == "PASS" and prompts["pd_transfer"]["verdict"] == "PASS"
    assert prompts["pd_transfer"]["metrics"]["rows_checked"] > 0
    for name, needs in (("concurrent", "staggered schedule"), ("prefix-cache", "prefix cache route")):
        (check,) = cells[name]["checks"]
        assert check["verdict"] == "SKIP" and needs in check["reason"] and "--engine embedded" in check["reason"]


def test_workloads_the_pd_client_cannot_send_skip_without_starting_a_server(tmp_path: Path) -> None:
    """Only workloads the P/D client cannot send: every cell a SKIP decided before any launch (no reference, no
    server, no run folder), exit 0."""
    code = main(["run", "--suite", "pd", "--engine", "harness-serve", "--topo", "tp2>tp1", "--model", "tiny-gqa",
                 "--workload", "concurrent,prefix-cache", "--out", str(tmp_path / "r"),
                 "--cache-dir", str(tmp_path / "cache")])
    cells = results_cells(tmp_path / "r")
    assert code == 0 and [c["status"] for c in cells] == ["SKIP", "SKIP"]
    assert not (tmp_path / "r" / "runs").exists() and not (tmp_path / "cache" / "runs").exists()
