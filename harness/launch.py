"""Launch one run: torchrun for world size > 1 (gloo on CPU, nccl with --device cuda), a plain
process at world size 1. Bounded in time; a crashed or hung rank ends the launch with every rank's
log tail recorded in the run directory's manifest, so nothing else is lost."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness.jsonio import write_json
from harness.engine.worker import Job

if TYPE_CHECKING:
    from harness.multinode import NodeLaunch

LOG_TAIL_LINES = 40
TERM_GRACE_S = 35.0
ARTIFACTS = ("manifest.json", "tensors.safetensors", "layout.json", "cases.json", "gsm8k.json", "launcher.log")


@dataclass(frozen=True)
class LaunchResult:
    ok: bool
    returncode: int | None
    wall_s: float
    error: str
    log_tails: dict[str, str]


def rendezvous_args(world_size: int, nodes: "NodeLaunch | None") -> list[str]:
    """torchrun's placement: all ranks here (standalone), or this node's share of a multi-node launch."""
    if nodes is None:
        return ["--standalone", f"--nproc-per-node={world_size}"]
    return nodes.torchrun_args(world_size)


def command(job_path: Path, world_size: int, log_dir: Path, nodes: "NodeLaunch | None" = None) -> list[str]:
    worker = ["-m", "harness.engine.worker", str(job_path)]
    if world_size == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous_args(world_size, nodes),
            "--max-restarts=0", "--monitor-interval=0.5", f"--log-dir={log_dir}", "--redirects=3", *worker]


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _collect_rank_logs(run_dir: Path, log_dir: Path, world_size: int) -> dict[str, str]:
    """Copy torchrun's per-rank stdout/stderr into run_dir/rank{r}.log and return their tails."""
    tails = {}
    for rank in range(world_size):
        parts = sorted(log_dir.glob(f"**/attempt_*/{rank}/std*.log"))
        text = "".join(p.read_text(errors="replace") for p in parts)
        if text:
            (run_dir / f"rank{rank}.log").write_text(text)
        tails[f"rank{rank}"] = _tail(run_dir / f"rank{rank}.log")
    tails["launcher"] = _tail(run_dir / "launcher.log")
    return tails


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launch's process group, then SIGKILL. torchrun starts each rank in a session of its
    own and needs up to 30 s to stop them on SIGTERM, so it gets that long before the SIGKILL."""
    for sig, wait in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(job: Job, timeout_s: float, env: dict[str, str] | None = None,
           nodes: "NodeLaunch | None" = None) -> LaunchResult:
    """Run `job` to completion or until `timeout_s`; always leaves a manifest.json in job.out_dir."""
    run_dir = Path(job.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*ARTIFACTS, *(p.name for p in run_dir.glob("rank*.log"))]:  # nothing of an earlier launch
        (run_dir / stale).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "torchrun", ignore_errors=True)
    job_path = run_dir / "job.json"
    write_json(job_path, asdict(job))
    world = int(job.topology["tp"])
    log_dir = run_dir / "torchrun"
    start = time.time()
    timed_out = False
    with open(run_dir / ("launcher.log" if world > 1 else "rank0.log"), "wb") as log:
        proc = subprocess.Popen(command(job_path, world, log_dir, nodes), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:  # Ctrl-C or any error here: never leave ranks running
            _kill_group(proc)
            raise
    wall = time.time() - start
    tails = _collect_rank_logs(run_dir, log_dir, world) if world > 1 else {"rank0": _tail(run_dir / "rank0.log")}
    manifest_path = run_dir / "manifest.json"
    if not timed_out and proc.returncode == 0 and manifest_path.exists():
        return LaunchResult(True, 0, wall, "", tails)
    error = (f"run timed out after {timeout_s:.0f} s (a rank hung?)" if timed_out
             else f"launch exited with code {proc.returncode}" if proc.returncode
             else "launch exited cleanly but wrote no manifest")
    failed = [r for r, t in tails.items() if "Traceback" in t or "injected failure" in t or "Error" in t]
    if failed:
        error += f"; failing: {', '.join(failed)}"
    write_json(manifest_path, {"schema_version": 1, "status": "error", "error": error, "returncode": proc.returncode,
                               "timed_out": timed_out, "topology": job.topology, "fault": job.fault,
                               "seed": job.seed, "wall_s": {"total": wall}, "log_tails": tails})
    return LaunchResult(False, proc.returncode, wall, error, tails)
