"""An engine answering NaN, inf or null logprobs has produced wrong output: a FAIL of the check that read
them, naming the prompt, the position and the value, never a crash or an ERROR cell.

The engine is real: `harness serve` (tiny-gqa, tp2) behind a loopback proxy written with the stdlib
http.server, which forwards every request and, per mode, rewrites one logprob of the answers to null or
NaN before passing them on (as a server whose JSON encoder writes NaN as null would). The harness attaches
to the proxy with `--engine openai:URL` (echo + logprobs, the dialect that crashed on a null before),
against a harness-serve tp1 reference. Without a rewrite the same cell passes (the negative control)."""

from __future__ import annotations

import json
import math
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.backends.http.server import Server
from harness.cli import main
from harness.core.jsonio import read_json
from harness.records.results import results_cells
from tests.test_serve import serving

pytestmark = pytest.mark.xdist_group("http-nonfinite")  # one server, one cached reference

MODES: dict[str, Any] = {"mode": "clean"}  # what the proxy rewrites; set per test
POSITION = 3  # the echo/generation entry rewritten (echo entry i scores prompt token i: position i - 1)


def rewrite(body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """The answer with the first top logprob of entry POSITION of choice 0 replaced, per MODES['mode']."""
    mode = MODES["mode"]
    echo = bool(body.get("echo"))
    if mode == "clean" or (mode == "null-prompt") != echo:
        return answer
    top = answer["choices"][0]["logprobs"]["top_logprobs"][POSITION]
    first = max(top, key=top.get)
    top[first] = None if mode == "null-prompt" else math.nan
    MODES["token"] = int(first.split(":")[1])
    return answer


class Proxy(BaseHTTPRequestHandler):
    upstream = ""

    def _forward(self, data: bytes | None) -> None:
        request = urllib.request.Request(self.upstream + self.path, data=data, method=self.command,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as answer:
                status, payload = answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            status, payload = exc.code, exc.read()
        if data is not None and status == 200 and self.path == "/v1/completions":
            payload = json.dumps(rewrite(json.loads(data), json.loads(payload))).encode()  # NaN written as NaN
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._forward(None)

    def do_POST(self) -> None:  # noqa: N802
        self._forward(self.rfile.read(int(self.headers.get("Content-Length", "0"))))

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    upstream: Server
    with serving(tmp_path_factory.mktemp("nonfinite-serve"), "tp2", 128, 8) as upstream:
        handler = type("Bound", (Proxy,), {"upstream": upstream.base_url})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}"
        finally:
            httpd.shutdown()
            httpd.server_close()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nonfinite-cache")


def _cell(out: Path, cache: Path, url: str, mode: str) -> tuple[int, dict[str, Any]]:
    MODES["mode"] = mode
    code = main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--engine", f"openai:{url}",
                 "--reference-engine", "harness-serve", "--out", str(out), "--cache-dir", str(cache),
                 "--kv-budget-mib", "8", "--max-seq-len", "128", "--workload", "prompts"])
    (cell,) = results_cells(out)
    return code, cell


def _checks(cell: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in cell["checks"]}


@pytest.mark.slow
def test_finite_logprobs_through_the_proxy_pass(tmp_path: Path, cache: Path, proxy: str) -> None:
    code, cell = _cell(tmp_path / "clean", cache, proxy, "clean")
    checks = _checks(cell)
    assert code == 0 and cell["status"] == "PASS", cell["checks"]
    assert {n: checks[n]["verdict"] for n in ("logits_prefill", "logits_decode", "generation")} == {
        "logits_prefill": "PASS", "logits_decode": "PASS", "generation": "PASS"}


@pytest.mark.slow
def test_a_null_prompt_logprob_fails_the_prefill_check_naming_it(tmp_path: Path, cache: Path, proxy: str) -> None:
    code, cell = _cell(tmp_path / "null", cache, proxy, "null-prompt")
    checks = _checks(cell)
    assert code == 1 and cell["status"] == "FAIL" and cell["silent_corruption"], cell["checks"]
    assert checks["logits_prefill"]["verdict"] == "FAIL"
    assert checks["logits_prefill"]["reason"] == (
        f"prefill (top-5): parallel prefill_topk_logprobs of prompt 0: NaN at position {POSITION - 1} "
        f"(token {MODES['token']}; the engine answered null)")
    manifest = read_json(Path(cell["run_dir"]) / "manifest.json")
    assert manifest["nonfinite_logprobs"] == [{"case": 0, "kind": "prefill_topk_logprobs", "row": POSITION - 1,
                                               "token": MODES["token"], "value": "null"}]
    assert checks["generation"]["verdict"] == "PASS"  # the generation's answers were finite


@pytest.mark.slow
def test_nan_generation_logprobs_fail_the_checks_reading_them(tmp_path: Path, cache: Path, proxy: str) -> None:
    code, cell = _cell(tmp_path / "nan", cache, proxy, "nan-generation")
    checks = _checks(cell)
    assert code == 1 and cell["status"] == "FAIL" and cell["silent_corruption"], cell["checks"]
    where = f"parallel gen_topk_logprobs of prompt 0: NaN at generation step {POSITION} (token {MODES['token']})"
    assert checks["generation"]["verdict"] == "FAIL" and checks["generation"]["reason"] == where
    assert checks["logits_decode"]["verdict"] == "FAIL"
    assert checks["logits_decode"]["reason"] == f"decode (greedy walk): {where}"
    assert checks["logits_prefill"]["verdict"] == "PASS"
    assert not any(c["verdict"] == "ERROR" for c in cell["checks"])
