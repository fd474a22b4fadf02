"""SIGTERM (a CI cancel) and SIGINT (Ctrl-C) during a real `harness run` subprocess: every process
it started is gone, no half-written reference sits in the cache, the finished cells are reported
(marked interrupted), one line on stderr, exit 128 + signum. An injected hang holds the run at a known
point (a launch of a tiny model is over in a second), and every process of the run carries a marker in
its environment (ranks forked from the warm launcher's forkserver have the forkserver's command line)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.backends.embedded.worker import INJECT_ENV

SUITE = """
name: sig
version: 1
models: [tiny-gqa]
topologies: [tp2, tp2dcp2, tp4]
max_new_tokens: 4
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is"]
checks: {layout: {}, logits: {}, generation: {}}
workloads: [prompts, concurrent]
"""
MARKER_ENV = "HARNESS_SIGNAL_TEST"
WAIT_S = 240.0  # a launch under load takes seconds; the wait only bounds a broken test


class Harness:
    """`harness run` in a session of its own, its stdout read line by line on a thread."""

    def __init__(self, tmp: Path, hang_rank: int) -> None:
        (tmp / "sig.yaml").write_text(SUITE)
        self.cache, self.out = tmp / "cache", tmp / "out"
        self.marker = f"{MARKER_ENV}={tmp}"  # in the environment of every process the run starts
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness", "run", "--suite", str(tmp / "sig.yaml"), "--out", str(self.out),
             "--cache-dir", str(self.cache)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, MARKER_ENV: str(tmp), INJECT_ENV: f"hang:{hang_rank}"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate: object, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():  # type: ignore[operator]
            assert self.proc.poll() is None, f"harness exited before {what}: {self.lines}"
            assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s: {self.lines}"
            time.sleep(0.1)

    def finish(self) -> tuple[int, str]:
        rc = self.proc.wait(timeout=WAIT_S)
        self._reader.join(timeout=10)
        assert self.proc.stderr is not None
        return rc, self.proc.stderr.read()


def processes_naming(marker: str) -> list[str]:
    """Command lines of live processes with `marker` in their environment (zombies have an empty one)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ, argv = (proc / "environ").read_bytes().split(b"\0"), (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in environ:
            found.append(" ".join(a.decode(errors="replace") for a in argv))
    return found


def _no_children_left(marker: str) -> list[str]:
    """Live processes of the run a few seconds after it exited (a SIGKILLed rank needs a moment)."""
    deadline = time.monotonic() + 10
    while (left := processes_naming(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")


def test_sigterm_mid_run_stops_every_rank_and_reports_finished_cells(tmp_path: Path) -> None:
    h = Harness(tmp_path, hang_rank=3)  # tp2 and tp2dcp2 finish; rank 3 of the tp4 launch hangs
    hung = h.out / "runs" / "tiny-gqa" / "tp4" / "seed0" / "ranks" / "rank3.log"
    # the third cell launches while the second's checks run: wait for both (its hang, the second's results)
    h.wait_for(lambda: "injected failure: hang on rank 3" in (hung.read_text() if hung.exists() else "")
               and any("tp2dcp2/seed0 concurrent: PASS" in line for line in h.lines), "a running third cell")
    h.proc.send_signal(signal.SIGTERM)
    rc, err = h.finish()
    assert rc == 128 + signal.SIGTERM == 143
    assert _no_children_left(h.marker) == []
    assert list(h.cache.rglob("*.partial")) == []
    lines = [line for line in err.splitlines() if line.strip()]
    # two workloads per launch: 4 cells of 6 finished; the two of the hung launch are listed as not run
    assert len(lines) == 1 and "interrupted by SIGTERM after 4 of 6 cells" in lines[0], err
    doc = json.loads((h.out / "results.json").read_text())
    assert doc["provenance"]["interrupted"] == {"signal": "SIGTERM", "cells_finished": 4, "cells_planned": 6}
    assert [(c["topology"], c["workload"], c["status"], c["checks"][0]["name"]) for c in doc["cells"]] == [
        ("tp2", "prompts", "PASS", "inputs"), ("tp2", "concurrent", "PASS", "inputs"),
        ("tp2dcp2", "prompts", "PASS", "inputs"), ("tp2dcp2", "concurrent", "PASS", "inputs"),
        ("tp4", "prompts", "ERROR", "not_run"), ("tp4", "concurrent", "ERROR", "not_run")]
    assert "interrupted by SIGTERM" in doc["cells"][-1]["checks"][0]["reason"]
    html = (h.out / "index.html").read_text()
    assert "INTERRUPTED" in html and "interrupted by SIGTERM after 4 of 6 cells" in html
    assert "2 cells not run" in html
    summary = (h.out / "summary.md").read_text()
    assert "INTERRUPTED" in summary and "not run" in summary


def test_sigint_during_the_reference_run_leaves_no_partial_cache_entry(tmp_path: Path) -> None:
    h = Harness(tmp_path, hang_rank=0)  # the reference (tp1) hangs
    h.wait_for(lambda: any("injected failure: hang on rank 0" in p.read_text(errors="replace")
                           for p in h.cache.glob("runs/*.partial/rank0.log")), "a reference run being written")
    h.proc.send_signal(signal.SIGINT)
    rc, err = h.finish()
    assert rc == 128 + signal.SIGINT == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert _no_children_left(h.marker) == []
    assert list(h.cache.rglob("*.partial")) == []
    doc = json.loads((h.out / "results.json").read_text())
    assert doc["provenance"]["interrupted"]["signal"] == "SIGINT"
    assert len(doc["cells"]) == 6 and {c["checks"][0]["name"] for c in doc["cells"]} == {"not_run"}
