"""Launch one run: a plain process at world size 1, else ranks forked from one launcher process
(gloo on CPU, harness/launcher/forkrun.py) or torchrun (nccl with --device cuda, and multi-node). On CPU
on one node that process is itself forked from a forkserver that imported torch and the engine once
(harness/launcher/forkserver.py), so a launch costs no interpreter start. Bounded in time; a crashed
or hung rank ends the launch with every rank's log tail recorded in the run directory's manifest, so
nothing else is lost."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence, Union

from harness.core.errors import ConfigError
from harness.core.jsonio import write_json
from harness.launcher import forkserver
from harness.records.contract import JOB_FILE, LAUNCHER_LOG, MANIFEST_FILE, RUN_FILES, Job, LaunchResult

FORKRUN_MODULE = "harness.launcher.forkrun"

if TYPE_CHECKING:
    from harness.launcher.nodes import NodeLaunch

Process = Union["subprocess.Popen[bytes]", forkserver.WarmProcess]  # a launch's top process

LOG_TAIL_LINES = 40
TERM_GRACE_S = 35.0
THREADS_ENV = "HARNESS_THREADS_PER_PROCESS"  # override of the per-process thread count
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
WAIT_POLICY_VAR = forkserver.WAIT_POLICY_VAR  # OMP_WAIT_POLICY
# every launch still running, whatever thread started it (stop_all_launches)
_LIVE: set["Process"] = set()
_LIVE_LOCK = threading.Lock()
LAUNCHER_ENV = "HARNESS_LAUNCHER"  # fork (default for CPU runs on one node) | torchrun
LAUNCHERS = ("fork", "torchrun")


def launcher_choice(device: str, multi_node: bool, setting: str | None) -> str:
    """'fork' (harness/launcher/forkrun.py) for a CPU run on one node unless HARNESS_LAUNCHER=torchrun
    says otherwise; 'torchrun' for CUDA devices and multi-node launches."""
    if setting and setting not in LAUNCHERS:
        raise ConfigError(f"{LAUNCHER_ENV}={setting!r} is not a launcher; valid: {', '.join(LAUNCHERS)}")
    if device != "cpu" or multi_node:
        return "torchrun"
    return setting or "fork"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rendezvous_args(world_size: int, nodes: "NodeLaunch | None") -> list[str]:
    """torchrun's placement: all ranks here (standalone), or this node's share of a multi-node launch."""
    if nodes is None:
        return ["--standalone", f"--nproc-per-node={world_size}"]
    return nodes.torchrun_args(world_size)


def command(job_path: Path, world_size: int, log_dir: Path, module: str, worker_args: Sequence[str] = (),
            nodes: "NodeLaunch | None" = None, launcher: str = "torchrun") -> list[str]:
    """`module` (the rank's worker, e.g. the embedded backend's) as one plain process at world size 1; else
    the fork launcher (harness/launcher/forkrun.py: the worker imported once, ranks forked from it) or
    torchrun (launcher_choice)."""
    worker = ["-m", module, str(job_path), *worker_args]
    if world_size == 1:
        return [sys.executable, *worker]
    if launcher == "fork":
        return [sys.executable, "-m", FORKRUN_MODULE, f"--nproc={world_size}", f"--log-dir={log_dir}",
                f"--module={module}", "--", str(job_path), *worker_args]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous_args(world_size, nodes),
            "--max-restarts=0", "--monitor-interval=0.5", f"--log-dir={log_dir}", "--redirects=3", *worker]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_process(processes: int, cores: int, override: str | None = None) -> int:
    """Intra-op threads for each of `processes` ranks on `cores` cores: cores // processes (at least 1),
    so the ranks together never oversubscribe the machine; `override` (the HARNESS_THREADS_PER_PROCESS
    setting, a positive integer) wins when given."""
    if override:
        if not override.strip().isdigit() or int(override) < 1:
            raise ConfigError(f"{THREADS_ENV}={override!r} must be a positive integer (threads per process)")
        return int(override)
    return max(1, cores // max(1, processes))


def thread_env(processes: int, env: dict[str, str]) -> dict[str, str]:
    """OMP/MKL thread counts for a launch of `processes` ranks (torch reads them at start-up), and
    OpenMP's passive wait policy unless `env` sets one: idle OpenMP threads sleep instead of spinning,
    so a launch beside other work (another launch, a second test worker, a busy CI box) is not slowed
    several-fold by threads spinning for cores others hold (measured at load ~5 on 2 cores: a tp1
    SmolLM2 run took 13.2 s with 2 spinning threads, 4.3 s passive, 3.4 s with one thread)."""
    n = threads_per_process(processes, available_cores(), env.get(THREADS_ENV))
    return {**{var: str(n) for var in THREAD_VARS}, WAIT_POLICY_VAR: wait_policy(env)}


def wait_policy(env: Mapping[str, str]) -> str:
    """OpenMP's wait policy for what the harness starts: the environment's, else PASSIVE."""
    return env.get(WAIT_POLICY_VAR) or "PASSIVE"


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _collect_rank_logs(run_dir: Path, log_dir: Path, world_size: int) -> dict[str, str]:
    """Copy each rank's stdout/stderr (the fork launcher's log_dir/rank{r}.log, or torchrun's
    attempt_*/{r}/std*.log) into run_dir/rank{r}.log and return their tails."""
    tails = {}
    for rank in range(world_size):
        parts = sorted(log_dir.glob(f"rank{rank}.log")) or sorted(log_dir.glob(f"**/attempt_*/{rank}/std*.log"))
        text = "".join(p.read_text(errors="replace") for p in parts)
        if text:
            (run_dir / f"rank{rank}.log").write_text(text)
        tails[f"rank{rank}"] = _tail(run_dir / f"rank{rank}.log")
    tails["launcher"] = _tail(run_dir / LAUNCHER_LOG)
    return tails


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc; empty elsewhere). torchrun's ranks sit in sessions
    of their own, so killing torchrun's process group alone would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_groups(pids: list[int], sig: int) -> None:
    """Send `sig` to the process group of each pid (each group once); gone ones are skipped."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    for group in groups - {os.getpgrp()}:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            continue


def _kill_group(proc: "Process") -> None:
    """SIGTERM the launch's process group and the groups of all its descendants (torchrun starts each
    rank in a session of its own), then SIGKILL whatever is left. torchrun gets up to TERM_GRACE_S to
    stop before the SIGKILL."""
    pids = [proc.pid, *descendants(proc.pid)]
    for sig, wait in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        _signal_groups(pids, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _signal_groups(pids, signal.SIGKILL)  # ranks that outlived torchrun


_FIRST_FAILURE = re.compile(r"^first failure: rank (\d+) exited with code (-?\d+)", re.M)  # forkrun.py


def _code_text(code: int) -> str:
    """'exited with code 1' / 'was killed by SIGKILL (exit code 137)'; negative codes are signals (Popen's)."""
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        name = signal.Signals(signum).name if signum else ""
    except ValueError:
        name = ""
    return f"was killed by {name} (exit code {128 + signum})" if name else f"exited with code {code}"


def exit_text(launcher_log: str, returncode: int) -> str:
    """Why a launch failed: the first rank that failed and how (the fork launcher names it), else the
    launch's own exit."""
    found = _FIRST_FAILURE.search(launcher_log)
    if found:
        return f"rank {found.group(1)} {_code_text(int(found.group(2)))}; the launcher stopped the other ranks"
    return f"launch {_code_text(returncode)}"


_ABSENT = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:[\w.]+Error: )?(.*waiting for member \d+ of \d+ \(rank (\d+)\b.*)$",
                     re.M)  # harness/engine/runtime/shm_group.py's timeout


def absent_rank(tails: dict[str, str]) -> tuple[int, str] | None:
    """(rank, the waiting rank's line) when ranks timed out waiting for one that never arrived at a
    collective: that rank hung, was stopped or died, whoever gave up first."""
    for name, text in tails.items():
        found = _ABSENT.search(text) if name.startswith("rank") else None
        if found:
            return int(found.group(2)), f"{name}: {found.group(1).strip()[:300]}"
    return None


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+(?:Error|Exception|Interrupt)|injected failure)\b.*)$")


def root_cause(tails: dict[str, str]) -> str:
    """'rankN: <its last error line>' for the rank torchrun names as the root cause (else the first
    rank with an error line), so an ERROR cell's reason holds the error itself, not only a log tail."""
    launcher = tails.get("launcher", "")
    named = (re.findall(r"^first failure: rank (\d+)", launcher, re.M)  # harness/launcher/forkrun.py
             or re.findall(r"Root Cause.*?\n.*?rank\s*:\s*(\d+)", launcher, re.S))  # torchrun
    order = [f"rank{named[0]}"] if named else []
    order += [r for r in tails if r.startswith("rank") and r not in order]
    for rank in order:
        lines = [m.group(1).strip() for line in tails.get(rank, "").splitlines()
                 if (m := _ERROR_LINE.match(line.strip()))]
        if lines:
            return f"{rank}: {lines[-1][:300]}"
    return ""


def _child_env(local_ranks: int, extra: dict[str, str] | None) -> dict[str, str]:
    """The launch's environment with thread counts for the `local_ranks` processes on this node."""
    merged = {**os.environ, **(extra or {})}
    return {**merged, **thread_env(local_ranks, merged)}


def _start(job_path: Path, world: int, log_dir: Path, module: str, worker_args: Sequence[str],
           nodes: "NodeLaunch | None", launcher: str, env: dict[str, str], log_path: Path) -> "Process":
    """The launch's top process in a session of its own, output to `log_path`: with the fork launcher,
    forked warm from the forkserver (harness/launcher/forkserver.py) where it can be, else started fresh."""
    if launcher == "fork" and forkserver.usable(env):
        return forkserver.start(world, log_path, log_dir if world > 1 else None, module, [str(job_path), *worker_args],
                                env)
    with open(log_path, "wb") as log:
        return subprocess.Popen(command(job_path, world, log_dir, module, worker_args, nodes, launcher), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop_process_tree(proc: Process) -> None:
    """Stop `proc` (started with start_new_session=True) and every process it started, as a launch does;
    the HTTP backends stop their engine servers with it."""
    _kill_group(proc)


def stop_all_launches() -> None:
    """Stop every launch still running, in any thread (a run interrupted in one thread while another thread's
    launch goes on, e.g. the noise run beside an interrupted reference: its ranks never outlive the harness)."""
    with _LIVE_LOCK:
        running = list(_LIVE)
    for proc in running:
        _kill_group(proc)


def launch(job: Job, timeout_s: float, module: str, env: dict[str, str] | None = None,
           worker_args: Sequence[str] = (), nodes: "NodeLaunch | None" = None,
           world_size: int | None = None) -> LaunchResult:
    """Run `job` on its ranks, each running `module`'s main(job file, worker flags), to completion or until
    `timeout_s`; always leaves a manifest.json in job.out_dir. `worker_args` are extra worker flags
    (e.g. `--topk 20`: the top-k-only mode); `world_size` replaces the topology's (the prefill world of a
    disaggregated topology)."""
    run_dir = Path(job.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*RUN_FILES, *(p.name for p in run_dir.glob("rank*.log"))]:  # nothing of an earlier launch
        (run_dir / stale).unlink(missing_ok=True)
    for old_logs in ("torchrun", "ranks"):
        shutil.rmtree(run_dir / old_logs, ignore_errors=True)
    job_path = run_dir / JOB_FILE
    write_json(job_path, job.to_dict())
    world = world_size or job.topology.world_size
    child_env = _child_env(world // (nodes.nnodes if nodes else 1), env)
    launcher = launcher_choice(job.device, nodes is not None, child_env.get(LAUNCHER_ENV))
    log_dir = run_dir / ("ranks" if launcher == "fork" else "torchrun")
    start = time.time()
    timed_out = False
    proc = _start(job_path, world, log_dir, module, worker_args, nodes, launcher, child_env,
                  run_dir / (LAUNCHER_LOG if world > 1 else "rank0.log"))
    with _LIVE_LOCK:
        _LIVE.add(proc)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    except BaseException:  # Ctrl-C or any error here: never leave ranks running
        _kill_group(proc)
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    wall = time.time() - start
    tails = _collect_rank_logs(run_dir, log_dir, world) if world > 1 else {"rank0": _tail(run_dir / "rank0.log")}
    manifest_path = run_dir / MANIFEST_FILE
    if not timed_out and proc.returncode == 0 and manifest_path.exists():
        return LaunchResult(True, 0, wall, "", tails)
    error = (f"killed after {wall:.1f} s by the launch timeout (--timeout {timeout_s:g}): a rank hung or ran "
             f"too long" if timed_out
             else exit_text(tails.get("launcher", ""), proc.returncode) if proc.returncode
             else "launch exited cleanly but wrote no manifest")
    absent = absent_rank(tails)
    if absent is not None:  # the rank the others waited for is the cause, not the first to give up
        error = f"rank {absent[0]} never arrived at a collective (hung, stopped or dead): {absent[1]}; {error}"
    empty = [r for r, text in tails.items() if r.startswith("rank") and not text.strip()]
    if empty:
        error += (f"; {len(empty)} of {world} rank logs empty" if len(empty) > 1 or world > 1
                  else "; its rank log is empty")
    failed = [r for r, t in tails.items() if "Traceback" in t or "injected failure" in t or "Error" in t]
    if failed:
        error += f"; failing: {', '.join(failed)}"
    cause = root_cause(tails)
    if cause:
        error += f"; {cause}"
    write_json(manifest_path, {"schema_version": 1, "status": "error", "error": error, "returncode": proc.returncode,
                               "timed_out": timed_out, "topology": job.topology.to_dict(), "fault": job.fault,
                               "seed": job.seed, "wall_s": {"total": wall}, "log_tails": tails})
    return LaunchResult(False, proc.returncode, wall, error, tails)
