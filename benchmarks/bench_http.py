"""What HTTP decode-path parity and request schedules cost. Prints numbers; asserts nothing.

1. `harness run --suite dcp --engine harness-serve --topo T` wall seconds per topology set, and the
   milliseconds of the checks that read the runs: `logits_decode` (the greedy walk over the generations'
   top-k, harness/compare/parity/decode_walk.py) next to `logits_prefill` (top-k of the teacher-forced prefill),
   each timed on the run folders that run left (reference, noise and parallel).
2. One job of the dcp suite's prompts sent to one `harness serve` (tiny-gqa at --serve-topo) by each request
   schedule: the backend's run wall seconds and each phase's span (first send to last answer), with the
   most requests open at once.

    python benchmarks/bench_http.py [--topos tp2dcp2,tp4dcp4] [--serve-topo tp2] [--repeats 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from harness.backends.http.backend import HttpBackend
from harness.backends.http.server import free_port, running_server, wait_ready
from harness.cli import main as harness_main
from harness.compare.parity.decode_walk import check_decode_walk
from harness.compare.parity.topk import check_topk
from harness.compare.settings import LogitsSettings
from harness.core.jsonio import read_json
from harness.formats.locate import load_model
from harness.records.artifacts import read_run
from harness.records.contract import Job
from harness.specs.send_schedule import SendSchedule
from harness.specs.suite import read_suite
from harness.specs.topology import parse_topology_name

SCHEDULES: tuple[str | None, ...] = (None, "one-at-a-time", "all-at-once", "staggered:wave=2,delay_s=0.05")


def _ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - start) / repeats


def _noise_run(reference: Path) -> Any:
    """The reference's noise twin: the cache entry beside it, named like it with '-r-' before the key."""
    stem = reference.name.rsplit("-", 1)[0]
    twins = sorted(reference.parent.glob(f"{stem}-r-*"))
    return read_run(twins[0]) if twins else None


def suite_run(work: Path, topos: str, repeats: int) -> None:
    out = work / "dcp"
    start = time.perf_counter()
    code = harness_main(["run", "--suite", "dcp", "--topo", topos, "--engine", "harness-serve", "--out", str(out),
                         "--cache-dir", str(work / "cache")])
    wall = time.perf_counter() - start
    print(f"\n`harness run --suite dcp --engine harness-serve --topo {topos}`: exit {code}, {wall:.1f} s wall "
          f"(references from a cold cache)\n")
    print("| cell | logits_decode (walk) ms | steps compared | logits_prefill (top-k) ms | positions |")
    print("| --- | --- | --- | --- | --- |")
    for cell in read_json(out / "results.json")["cells"]:
        ref, par = read_run(Path(cell["reference_dir"])), read_run(Path(cell["run_dir"]))
        noise = _noise_run(Path(cell["reference_dir"]))
        settings = LogitsSettings()
        walk, _ = check_decode_walk(ref, par, noise, settings, 20)
        prefill, _ = check_topk("prefill", ref, par, noise, settings, 20)
        walk_ms = _ms(lambda: check_decode_walk(ref, par, noise, settings, 20), repeats)
        prefill_ms = _ms(lambda: check_topk("prefill", ref, par, noise, settings, 20), repeats)
        print(f"| {cell['model']} {cell['topology']} | {walk_ms:.1f} | {walk.metrics.get('steps_compared')} | "
              f"{prefill_ms:.1f} | {prefill.metrics.get('positions')} |")


def schedules(work: Path, serve_topo: str, repeats: int) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "harness", "serve", "--model", "tiny-gqa", "--topo", serve_topo, "--port", str(port),
            "--max-seq-len", "256", "--kv-budget-mib", "8"]
    template = work / "attached-serve.yaml"
    template.write_text("description: harness serve attached by URL\ndialect: vllm\nurl: http://127.0.0.1:1\n"
                        "health: /health\nmax_logprobs: 20\n")
    prompts = list(read_suite("dcp").prompts)
    print(f"\n{len(prompts)} prompts of the dcp suite sent to `harness serve --model tiny-gqa --topo {serve_topo}`, "
          f"median of {repeats}:\n")
    print("| request schedule | run wall s | score phase s | generate phase s | most in flight (score / generate) |")
    print("| --- | --- | --- | --- | --- |")
    with running_server(argv, {}, work / "server.log", f"http://127.0.0.1:{port}") as server:
        wait_ready(server, "/health", 300)
        backend = HttpBackend(str(template), server.base_url)
        for schedule in SCHEDULES:
            walls: list[float] = []
            spans: dict[str, list[float]] = {"score": [], "generate": []}
            most: dict[str, Any] = {}
            for r in range(repeats):
                job = Job(model=load_model("tiny-gqa"), topology=parse_topology_name(serve_topo), prompts=prompts,
                          out_dir=str(work / "send" / f"{schedule}-{r}"),
                          request_schedule=SendSchedule.parse(schedule))
                start = time.perf_counter()
                result = backend.run(job, 600.0)
                walls.append(time.perf_counter() - start)
                if not result.ok:
                    raise SystemExit(result.error)
                record = read_json(Path(job.out_dir) / "manifest.json").get("requests")
                if record:
                    for phase in spans:
                        spans[phase].append(max(t["answered_s"] for t in record["requests"] if t["phase"] == phase))
                    most = record["max_in_flight_seen"]
            span = {p: f"{statistics.median(v):.2f}" if v else "-" for p, v in spans.items()}
            name = schedule or "none (one request, all cases)"
            print(f"| {name} | {statistics.median(walls):.2f} | {span['score']} | {span['generate']} | "
                  f"{most.get('score', '-')} / {most.get('generate', '-')} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topos", default="tp2dcp2,tp4dcp4")
    parser.add_argument("--serve-topo", default="tp2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        suite_run(work, args.topos, args.repeats)
        schedules(work, args.serve_topo, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
