"""Issue 48's cases, each a regression test: inputs that gave a traceback (a model YAML that is a list, a 300-character
--out, --timeout 1e300, a results.json cell with `model: null`, a P/D store that is a file), a suite whose reference is
disaggregated, two runs into one output folder, an attached server that answers nothing. Each is one `harness:
error:` line with exit 2 naming the bad value (or a correct result), before anything launches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.backends.http.attached import ATTACHED_READY_S, probe_attached, wait_attached
from harness.backends.http.server import Server, ServerError, free_port, running_server, wait_ready
from harness.checks.settings import load_suite
from harness.cli import main
from harness.cli.resources import activations, machine_memory_bytes, require_activation_memory
from harness.core.errors import ConfigError
from harness.core.folder_lock import LOCK_FILE, hold_folder
from harness.formats.locate import load_model
from harness.launcher.orphans import OWNER_ENV, Marked, marked_processes, owner_alive, owner_token
from harness.specs.topology import load_catalog, parse_topology_name
from tests.report_fixtures import RESULTS_DIR


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("harness: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _run(tmp_path: Path, *extra: str) -> list[str]:
    return ["run", "--suite", "dcp", "--topo", "tp2", "--cache-dir", str(tmp_path / "cache"), *extra]


def test_model_yaml_whose_top_level_is_a_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "listmodel.yaml"
    spec.write_text("- heads\n- 4\n")
    assert main(["plan", "--model", str(spec), "--topo", "tp2"]) == 2
    assert "expected a mapping" in _error_line(capsys)


@pytest.mark.parametrize("field,value", [("hidden", '"32"'), ("heads", "null"), ("rope_theta", ".inf")])
def test_model_yaml_field_of_the_wrong_type_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     field: str, value: str) -> None:
    text = (Path(__file__).parents[1] / "models" / "tiny-gqa.yaml").read_text()
    spec = tmp_path / "m.yaml"
    spec.write_text(text + f"\n{field}: {value}\n" if field not in text else
                    "\n".join(f"{field}: {value}" if line.startswith(f"{field}:") else line
                              for line in text.splitlines()))
    assert main(["plan", "--model", str(spec), "--topo", "tp2"]) == 2
    line = _error_line(capsys)
    assert f"{field} must be" in line, line


def test_engine_template_with_an_integer_health_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (Path(__file__).parents[1] / "engines" / "harness-serve.yaml").read_text()
    engine = tmp_path / "e.yaml"
    engine.write_text(text + "\nhealth: 300\n")
    assert main(_run(tmp_path, "--out", str(tmp_path / "out"), "--engine", str(engine))) == 2
    assert "health must be a string, got 300" in _error_line(capsys)


def test_out_name_longer_than_the_file_system_allows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_run(tmp_path, "--out", str(tmp_path / ("x" * 300)))) == 2
    line = _error_line(capsys)
    assert "--out" in line and "300 bytes" in line and "255" in line, line
    assert not (tmp_path / "cache" / "runs").exists()


@pytest.mark.parametrize("flag,value,maximum", [("--timeout", "1e300", "604800 seconds"),
                                                ("--collective-timeout", "1e300", "604800 seconds"),
                                                ("--max-seq-len", "99999999999", "16777216 tokens"),
                                                ("--seed", str(1 << 63), "9223372036854775807")])
def test_absurd_numbers_have_a_stated_maximum(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str,
                                              value: str, maximum: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_run(tmp_path, "--out", str(tmp_path / "out"), flag, value))
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert flag in line and value in line and maximum in line, line


def _results_run(tmp_path: Path, doc: dict[str, Any]) -> Path:
    """A run folder holding `doc` as its results.json."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(doc))
    return run


@pytest.mark.parametrize("field,value,said", [
    ("model", None, "cell 0: model must be a string, got null"),
    # a seed no engine or history store can hold: one line naming the cell, never an overflow inside
    ("seed", 10 ** 30, "cell 0: seed must be an integer from 0 to 9223372036854775807, got 1000000000000")])
@pytest.mark.parametrize("command", ["report", "history"])
def test_results_cell_with_a_field_no_reader_can_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      command: str, field: str, value: Any, said: str) -> None:
    doc = json.loads((RESULTS_DIR / "clean" / "results.json").read_text())
    doc["cells"][0][field] = value
    run = _results_run(tmp_path, doc)
    argv = {"report": ["report", str(run), "--out", str(tmp_path / "out")],
            "history": ["history", "add", str(run), "--history", str(tmp_path / "h.db")]}[command]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert said in line and "constraint" not in line, line


def test_a_provenance_part_of_another_type_still_renders(tmp_path: Path) -> None:
    """A hand-edited results.json whose provenance holds a list where the report reads an object (the reference
    engine's record): the report renders what it can read, the cells' verdicts unchanged."""
    doc = json.loads((RESULTS_DIR / "clean" / "results.json").read_text())
    doc["provenance"]["backends"] = {"parallel": "embedded", "reference": [1, 2]}
    doc["provenance"]["attention_backends"] = [3]
    run = _results_run(tmp_path, doc)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "PASS" in (tmp_path / "out" / "index.html").read_text()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_pd_store_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str) -> None:
    store = tmp_path / "store"
    store.write_text("not a folder")
    assert main(["serve", "--model", "tiny-gqa", "--topo", "tp2>tp1", "--pd-role", role, "--pd-store", str(store),
                 "--port", "0"]) == 2
    line = _error_line(capsys)
    assert f"--pd-store {store} is a file" in line, line


SMALL_SUITE = """
name: small
version: 1
models: [tiny-gqa]
topologies: [tp2]
seeds: [0]
max_new_tokens: 4
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is"]
checks: {layout: {}, logits: {}, generation: {}}
"""


def test_a_suite_seed_beyond_64_bits_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "small.yaml"
    suite.write_text(SMALL_SUITE.replace("seeds: [0]", f"seeds: [0, {1 << 63}]"))
    assert main(["run", "--suite", str(suite), "--topo", "tp2", "--out", str(tmp_path / "out")]) == 2
    line = _error_line(capsys)
    assert f"seed={1 << 63} must be <= {(1 << 63) - 1}" in line, line


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    """Until `path` exists (the run holds its folder) or `proc` has ended."""
    while not path.exists() and proc.poll() is None:
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_run_into_a_held_folder_is_refused_naming_the_owner(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs into one --out (the second started while the first runs): the second is exit 2 naming the first's
    pid and command; the first finishes with its own cell in results.json; `harness report` into the folder while
    the first runs is refused too."""
    suite = tmp_path / "small.yaml"
    suite.write_text(SMALL_SUITE)
    out, cache = tmp_path / "same", tmp_path / "cache"
    first = subprocess.Popen([sys.executable, "-m", "harness", "run", "--suite", str(suite), "--topo", "tp2",
                              "--out", str(out), "--cache-dir", str(cache)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(out / LOCK_FILE, first)
        assert first.poll() is None, first.communicate()[0]
        assert main(["run", "--suite", str(suite), "--topo", "tp1", "--out", str(out), "--cache-dir",
                     str(cache)]) == 2
        line = _error_line(capsys)
        assert f"--out {out} is in use by pid {first.pid}" in line and "--topo tp2" in line, line
        assert main(["report", str(RESULTS_DIR / "clean"), "--out", str(out)]) == 2
        assert f"is in use by pid {first.pid}" in _error_line(capsys)
    finally:
        log = first.communicate(timeout=600)[0]
    assert first.returncode == 0, log
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert [c["topology"] for c in cells] == ["tp2"]
    assert not (out / LOCK_FILE).exists()


def test_the_folder_lock_dies_with_its_holder(tmp_path: Path) -> None:
    """A holder killed with SIGKILL leaves its lock file behind but not its lock: the next command takes the
    folder at once."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from harness.core.folder_lock import hold_folder\n"
                               "with hold_folder(Path(sys.argv[1]), 'holder'):\n"
                               "    print('held', flush=True); time.sleep(600)", str(tmp_path / "out")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with pytest.raises(ConfigError, match=f"in use by pid {holder.pid}.*: holder"):
        with hold_folder(tmp_path / "out", "second"):
            pass
    holder.kill()
    holder.wait()
    assert (tmp_path / "out" / LOCK_FILE).exists()
    with hold_folder(tmp_path / "out", "third"):
        assert json.loads((tmp_path / "out" / LOCK_FILE).read_text())["command"] == "third"


@pytest.fixture(scope="module")
def decode_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A real `harness serve` of tiny-gqa as the decode side of tp2>tp1 (one process), its store empty."""
    folder = tmp_path_factory.mktemp("decode")
    store = folder / "store"
    port = free_port()
    argv = [sys.executable, "-m", "harness", "serve", "--model", "tiny-gqa", "--topo", "tp2>tp1", "--pd-role",
            "decode", "--pd-store", str(store), "--port", str(port), "--max-seq-len", "128", "--kv-budget-mib", "8"]
    with running_server(argv, {}, folder / "server.log", f"http://127.0.0.1:{port}") as srv:
        wait_ready(srv, "/health", 300)
        yield srv, store


def test_an_unknown_pd_namespace_is_an_error_to_the_client(decode_server: tuple[Server, Path]) -> None:
    server, store = decode_server
    answer = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": "tiny-gqa", "prompt": [[72, 101, 108, 108, 111]], "max_tokens": 2,
        "kv_transfer_params": {"namespace": "never-sent", "requests": [0]}})
    assert answer.status_code == 400, answer.text
    assert "namespace='never-sent' is not in this decode server's KV store" in answer.text
    assert not (store / "never-sent").exists()


def _attach(tmp_path: Path, attach: str, *extra: str) -> list[str]:
    return ["run", "--suite", "dcp", "--topo", "tp2", "--engine", "harness-serve", "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), "--attach", attach, *extra]


def test_an_attached_url_where_nothing_listens_is_refused_before_the_run(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_attach(tmp_path, "tp2=http://127.0.0.1:1")) == 2
    line = _error_line(capsys)
    assert "--attach tp2=http://127.0.0.1:1: nothing answers there" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache" / "runs").exists()


@pytest.mark.parametrize("extra,why", [((), "it serves topology tp2>tp1, not tp2"),
                                       (("--model", "tiny-kv6"), "it serves model tiny-gqa (harness serve "
                                                                 "/server_info), this run's model is tiny-kv6")])
def test_an_attached_server_serving_something_else_is_refused(decode_server: tuple[Server, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              extra: tuple[str, ...], why: str) -> None:
    url = decode_server[0].base_url
    assert main(_attach(tmp_path, f"tp2={url}", *extra)) == 2
    line = _error_line(capsys)
    assert f"--attach tp2={url}: {why}" in line, line


def test_an_attached_server_that_is_gone_is_reported_as_such() -> None:
    """An attached server that died mid-run: the next run's wait names the attached server's death after a few
    seconds, never the start-up timeout's 'not ready' of a server the harness started."""
    with pytest.raises(ServerError, match=r"attached server http://127.0.0.1:1 \(--attach\) is gone: /health has "
                                          r"not answered 200 for 1 s .*the harness did not start it"):
        wait_attached(Server(base_url="http://127.0.0.1:1", log_path=Path("unused.log")), "/health", timeout_s=1.0)
    assert ATTACHED_READY_S < 60  # the wait an attached run gets is seconds, not an engine's start-up timeout


def test_a_suite_whose_reference_is_disaggregated_is_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "pdref.yaml"
    suite.write_text(SMALL_SUITE + "reference: tp2>tp1\n")
    assert main(["run", "--suite", str(suite), "--out", str(tmp_path / "out"), "--cache-dir",
                 str(tmp_path / "cache")]) == 2
    line = _error_line(capsys)
    assert "reference='tp2>tp1' is a disaggregated PREFILL>DECODE topology" in line, line


def test_a_merged_report_headline_agrees_with_its_exit_status(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A clean build merged with a positive-control run: the headline is the build's (SHIPPABLE), and so is the
    exit status (0); a failing build merged with it stays NOT SHIPPABLE with exit 1."""
    code = main(["report", str(RESULTS_DIR / "clean"), str(RESULTS_DIR / "corruption"), "--out", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert "\nSHIPPABLE: " in out and code == 0, (code, out)
    doc = json.loads((RESULTS_DIR / "clean" / "results.json").read_text())
    doc["cells"][0]["checks"][0]["verdict"] = "FAIL"
    failing = tmp_path / "failing"
    failing.mkdir()
    (failing / "results.json").write_text(json.dumps(doc))
    code = main(["report", str(failing), str(RESULTS_DIR / "corruption"), "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert "NOT SHIPPABLE" in out and code == 1, (code, out)


@pytest.mark.parametrize("suite,model", [("dsa", "tiny-dsa"), ("moe-dp", "tiny-moe-dp"), ("dcp", "tiny-gqa")])
def test_a_cache_budget_shortfall_is_refused_before_any_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               suite: str, model: str) -> None:
    """--max-seq-len far beyond the budget, for the sparse and MoE-DP suites as for the dense ones: exit 2 naming
    the model, the topology and each cache group's shortfall; no cache entry, no run folder."""
    assert main(["run", "--suite", suite, "--max-seq-len", "10000000", "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache")]) == 2
    line = _error_line(capsys)
    assert f"{model} at tp" in line and "cannot hold one sequence slot" in line and "short by" in line, line
    assert not (tmp_path / "cache" / "runs").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value", [("hidden", 100_000_000), ("ffn", 10_000_000_000)])
def test_a_model_larger_than_the_machine_is_refused_with_the_figure(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str], field: str,
                                                                    value: int) -> None:
    spec = tmp_path / "big.yaml"
    text = (Path(__file__).parents[1] / "models" / "tiny-gqa.yaml").read_text()
    spec.write_text("\n".join(f"{field}: {value}" if line.startswith(f"{field}:") else line
                              for line in text.splitlines()) + "\n")
    assert main(["run", "--model", str(spec), "--topo", "tp2", "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache")]) == 2
    line = _error_line(capsys)
    assert "model big: its weights take" in line and "GiB of memory" in line, line
    assert not (tmp_path / "cache" / "runs").exists()


def _of(owner: int) -> list[Marked]:
    return [m for m in marked_processes() if m.owner_pid == owner]


def _started(engine: str, out: Path, run: subprocess.Popen[bytes]) -> bool:
    """Whether the run has started what its engine starts: ranks beside the forkserver and its resource tracker
    (embedded), an engine server (harness-serve)."""
    if engine == "harness-serve":
        return any(out.rglob("server.log"))
    return len(_of(run.pid)) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["embedded", "harness-serve"])
def test_no_process_outlives_a_run_killed_with_sigkill(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       engine: str) -> None:
    """`kill -9` of `harness run` (a CI timeout): the forkserver, its resource tracker, the ranks and the engine
    servers all end (the guardian), and `harness cache servers` finds nothing of it left."""
    suite = tmp_path / "small.yaml"
    suite.write_text(SMALL_SUITE)
    out = tmp_path / "out"
    with open(tmp_path / "run.log", "wb") as log:
        run = subprocess.Popen([sys.executable, "-m", "harness", "run", "--suite", str(suite), "--topo", "tp2",
                                "--engine", engine, "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while not _started(engine, out, run) and run.poll() is None:
        time.sleep(0.1)
    assert run.poll() is None, (tmp_path / "run.log").read_text()
    assert _of(run.pid), "the run's processes carry its mark"
    run.kill()
    run.wait()
    for _ in range(600):  # the guardian looks every half second; a minute at the most on a loaded machine
        if not _of(run.pid):
            break
        time.sleep(0.1)
    assert not _of(run.pid), [m.command for m in _of(run.pid)]
    assert main(["cache", "--cache-dir", str(tmp_path / "cache"), "servers"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert not [row for row in rows if len(row) > 1 and row[1] == str(run.pid)], rows  # nothing of it listed


def test_cache_servers_lists_and_stops_what_a_killed_run_left(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A process carrying the mark of a run that is gone (its guardian killed too): listed, then stopped."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    token = owner_token(gone.pid)
    gone.wait()
    assert token is not None and not owner_alive(token)
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env={**os.environ, OWNER_ENV: token})
    try:
        while not any(m.pid == left.pid for m in marked_processes()):
            time.sleep(0.05)
        assert main(["cache", "--cache-dir", str(tmp_path / "cache"), "servers"]) == 0
        listed = capsys.readouterr().out
        assert "process(es) left by harness runs that were killed" in listed, listed
        assert [str(left.pid), str(gone.pid)] in [line.split()[:2] for line in listed.splitlines()], listed
        assert main(["cache", "--cache-dir", str(tmp_path / "cache"), "servers", "--stop"]) == 0
        stopped = capsys.readouterr().out
        assert "process(es) left by killed harness runs:" in stopped and str(left.pid) in stopped, stopped
        assert left.wait(timeout=60) == -9
    finally:
        left.kill()


ENDPOINTS = Path(__file__).parent / "data" / "engine_endpoints"


@pytest.fixture(scope="module")
def foreign_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real HTTP server process answering as an engine does (tests/engine_endpoint_server.py) from a JSON file
    each test rewrites: (its URL, that file)."""
    folder = tmp_path_factory.mktemp("foreign")
    answers = folder / "answers.json"
    answers.write_text("{}")
    port = free_port()
    argv = [sys.executable, str(Path(__file__).parent / "engine_endpoint_server.py"), str(port), str(answers)]
    with running_server(argv, {}, folder / "server.log", f"http://127.0.0.1:{port}") as srv:
        wait_ready(srv, "/health", 60)
        yield srv.base_url, answers


def _answers(engine: str, path: str = "", field: str = "", value: Any = None) -> dict[str, Any]:
    """The recorded bodies of `engine`, with `field` of `path`'s body (of its first model card for /v1/models) set
    to `value` when a path is given."""
    bodies = json.loads((ENDPOINTS / f"{engine}.json").read_text())
    if path:
        body = bodies[path]
        (body["data"][0] if "data" in body else body)[field] = value
    return bodies


@pytest.mark.parametrize("engine,changes,why", [
    ("sglang", ("/get_server_info", "tp_size", 4),
     "it runs tp=4 (SGLang /get_server_info), topology tp2 needs tp=2, dcp=1, dp=1, ep=1"),
    ("sglang", ("/get_server_info", "served_model_name", "tiny-kv6"),
     "it serves model tiny-kv6 from /models/tiny-gqa (SGLang /get_server_info), this run's model is tiny-gqa"),
    ("vllm", ("/v1/models", "id", "tiny-kv6"),
     "it serves model tiny-kv6 from /models/tiny-gqa (vLLM /v1/models), this run's model is tiny-gqa"),
    ("vllm", ("/v1/models", "max_model_len", 256),
     "its max_model_len is 256 tokens (vLLM /v1/models), this run's sequences need 512 (--max-seq-len)")])
def test_an_attached_engine_serving_another_model_or_layout_is_refused(
        foreign_server: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], engine: str,
        changes: tuple[str, str, Any], why: str) -> None:
    """vLLM and SGLang servers are probed through what they expose (SGLang's /get_server_info and /get_model_info,
    vLLM's /v1/models): a wrong model, parallel size or context length is exit 2 naming the URL before the run;
    the same server answering the run's model and layout is accepted."""
    url, answers = foreign_server
    answers.write_text(json.dumps(_answers(engine)))
    assert probe_attached("tp2", url, "/health", ("tiny-gqa",), 512) is None  # the right one: accepted
    answers.write_text(json.dumps(_answers(engine, *changes)))
    assert main(_attach(tmp_path, f"tp2={url}", "--model", "tiny-gqa")) == 2
    line = _error_line(capsys)
    assert f"--attach tp2={url}: {why}" in line, line
    assert not (tmp_path / "out").exists()


def test_activations_larger_than_this_machine_are_refused_before_the_run(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose weights fit (1.5 GiB) but whose FFN activations of one 8192-token prefill do not (3 x 8192 x
    2^21 floats = 192 GiB) is exit 2 naming the figure, its largest part and the limit, before anything launches;
    `harness plan` prints the same figure."""
    text = (Path(__file__).parents[1] / "models" / "tiny-gqa.yaml").read_text()
    spec = tmp_path / "wide-ffn.yaml"
    spec.write_text("\n".join("ffn: 2097152" if line.startswith("ffn:") else "hidden: 32" if line.startswith("hidden:")
                              else line for line in text.splitlines()) + "\n")
    assert main(["run", "--suite", "dcp", "--topo", "tp2", "--model", str(spec), "--max-seq-len", "8192",
                 "--kv-budget-mib", "1024", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c")]) == 2
    line = _error_line(capsys)
    assert ("model wide-ffn: tp=1 (one process) needs 192.0 GiB of activations for one 8192-token prefill" in line
            and "ffn 192.0" in line and "GiB of memory" in line), line
    assert not (tmp_path / "out").exists() and not (tmp_path / "c" / "runs").exists()
    assert main(["plan", "--model", str(spec), "--topo", "tp2", "--max-seq-len", "8192"]) == 0
    assert ("peak activations of one 8192-token prefill (float32): 96.00 GiB per rank, 192.00 GiB over 2 ranks; "
            "reference (tp=1): 192.00 GiB + weights 1.50 GiB") in capsys.readouterr().out


def test_every_shipped_suite_fits_the_activation_check_and_the_formula_is_the_documented_one() -> None:
    """Negative control: every shipped suite's models at its topologies and slot length pass the check on this
    machine (the largest, gsm8k's smollm2-135m at tp3 and 768 tokens, needs well under 1 GiB). The figure for
    tiny-gqa (hidden 128, heads 8, kv_heads 2, head_dim 16, ffn 288, vocab 384) at tp1 and tp2, 512 tokens, by
    hand from docs/cli.md's formula."""
    t = 512
    residual = 2 * t * 128
    attention = t * (8 + 2 * 2) * 16 + 8 * t * t + t * 8 * 16  # the scores (8 * t * t) dominate
    assert activations(load_model("tiny-gqa"), 1, t).peak == 4 * (residual + attention)
    assert activations(load_model("tiny-gqa"), 2, t).peak == 4 * (residual + t * (4 + 2 * 1) * 16 + 4 * t * t
                                                                  + t * 4 * 16)
    for path in sorted((Path(__file__).parents[1] / "suites").glob("*.yaml")):
        suite = load_suite(str(path))
        names = set(suite.models) | {m for ms in suite.engine_models.values() for m in ms}
        topologies = [t for n in suite.topologies for t in load_catalog().resolve(n)]
        require_activation_memory([load_model(n) for n in sorted(names)],
                                  [*topologies, parse_topology_name(suite.reference)], suite.max_seq_len,
                                  machine_memory_bytes())


@pytest.mark.parametrize("extra,named", [(("--model", "x" * 300), "(300 characters) cannot be looked up"),
                                         (("--max-seq-len", "0"), "--max-seq-len: '0' must be an integer > 0"),
                                         (("--kv-budget-mib", "1e300"), "--kv-budget-mib: '1e300' is not a whole"),
                                         (("--dtype", "float33"), "--dtype 'float33' is not one of float32"),
                                         (("--spec-k", "0"), "--spec-k: '0' must be an integer > 0")])
def test_serve_options_are_checked_before_it_listens(capsys: pytest.CaptureFixture[str], extra: tuple[str, ...],
                                                     named: str) -> None:
    """`harness serve` with a model name longer than the file system allows (was a traceback) or a bad number or
    dtype (was taken as given and failed in the ranks): one line naming it, exit 2, checked before the port (held
    here: anything passing every check would end at `cannot listen`)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        argv = ["serve", "--model", "tiny-gqa", "--topo", "tp1", "--port", str(held.getsockname()[1]), *extra]
        try:
            code = main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    assert code == 2
    line = _error_line(capsys)
    assert named in line, line
