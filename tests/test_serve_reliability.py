"""`harness serve` when things go wrong: an address it cannot bind is one error line and exit 2 with every
rank gone; a client that goes away cancels its request (a later request does not wait for it) with one
log line and no traceback; a request naming another model is a 404 in OpenAI's error shape."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.backends.http.server import Server
from harness.formats.locate import load_model
from harness.serve.worker import ServeConfig
from harness.specs.topology import parse_topology_name
from tests.test_serve import serving

LONG = 1900  # tokens of the request that is abandoned (max_seq_len 2048)
PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture()
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _left_behind(marker: str) -> list[str]:
    """Processes whose command line holds `marker` (the port or the config of a finished server)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_a_taken_port_is_one_line_and_exit_2(taken_port: int) -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", "serve", "--model", "tiny-gqa", "--topo", "tp2",
                           "--port", str(taken_port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 10
    assert proc.stderr.strip().splitlines() == [
        f"harness: error: cannot listen on 127.0.0.1:{taken_port}: Address already in use"]
    assert not _left_behind(f"--port {taken_port}")


def test_a_host_that_does_not_resolve_is_one_line_and_exit_2() -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", "serve", "--model", "tiny-gqa", "--topo", "tp2",
                           "--host", "999.1.1.1", "--port", "8000"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 10
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harness: error: cannot listen on 999.1.1.1:8000: ")


def test_rank0_that_cannot_bind_stops_every_rank(taken_port: int) -> None:
    """The ranks' own check (the port taken after the CLI's): rank 0 tells the others, all exit."""
    config = ServeConfig(model=load_model("tiny-gqa"), topology=parse_topology_name("tp2"), port=taken_port)
    argv = [sys.executable, "-m", "harness.launcher.forkrun", "--nproc", "2", "--module", "harness.serve.worker",
            "--", config.to_json()]
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 20
    assert f"harness: error: cannot listen on 127.0.0.1:{taken_port}: Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not _left_behind(f'"port": {taken_port}')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("serve"), "tp2", 2048, 16) as srv:
        yield srv


def _complete(base_url: str, max_tokens: int, timeout: float) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", timeout=timeout,
                      json={"model": "tiny-gqa", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True})


def _wait_for_log(server: Server, text: str, count: int, within_s: float = 10.0) -> str:
    deadline = time.monotonic() + within_s
    while True:
        log = server.log_path.read_text(errors="replace")
        if log.count(text) >= count or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def test_an_abandoned_request_is_cancelled(server: Server) -> None:
    start = time.monotonic()
    solo = _complete(server.base_url, LONG, 300)
    long_s = time.monotonic() - start
    assert solo.status_code == 200 and len(solo.json()["choices"][0]["token_ids"]) == LONG
    assert long_s > 2.0, f"the long request took only {long_s:.1f} s: too short to tell"

    def abandon() -> None:
        with pytest.raises(httpx.ReadTimeout):
            _complete(server.base_url, LONG, 0.5)

    start = time.monotonic()
    clients = [threading.Thread(target=abandon) for _ in range(3)]  # one runs, two queue behind it
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    short = _complete(server.base_url, 4, 300)
    short_s = time.monotonic() - start
    assert short.status_code == 200 and len(short.json()["choices"][0]["token_ids"]) == 4
    # without cancelling, the short one waits for the long ones (one batch of them at least: >= long_s)
    assert short_s < 0.5 * long_s, f"short request took {short_s:.1f} s; one long request {long_s:.1f} s"
    log = _wait_for_log(server, "disconnected before the answer", 3)
    assert len(re.findall(r"client 127\.0\.0\.1:\d+ disconnected before the answer to POST /v1/completions: "
                          r"request cancelled", log)) == 3
    assert "Traceback" not in log


def test_a_disconnect_mid_body_is_one_line(server: Server) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": [1, 2,")
        time.sleep(0.3)
    log = _wait_for_log(server, "while sending the body", 1)
    assert len(re.findall(r"client \S+ disconnected while sending the body of POST /v1/completions", log)) == 1
    assert "Traceback" not in log
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "gpt-4", "prompt": [1, 2, 3], "max_tokens": 1}),
    ("/generate", {"model": "gpt-4", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
])
def test_another_model_is_404_naming_the_served_one(server: Server, path: str, body: dict[str, object]) -> None:
    answer = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["type"] == "NotFoundError" and error["code"] == 404
    assert "gpt-4" in error["message"] and "`tiny-gqa`" in error["message"]
    ok = httpx.post(f"{server.base_url}{path}", json={**body, "model": "tiny-gqa"}, timeout=60)
    assert ok.status_code == 200


def test_logs_are_clean(server: Server) -> None:
    assert "Traceback" not in Path(server.log_path).read_text(errors="replace")
