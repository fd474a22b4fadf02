"""Single-node CPU launcher: `python -m harness.launcher.forkrun --nproc N [--log-dir DIR] --module M -- ARGS`.

torchrun starts its agent and then a fresh interpreter per rank, and each imports torch and the
engine again: about 3 CPU-seconds apiece, more than a tiny model's whole run, paid N + 1 times per
launch. This launcher imports the worker once and forks the N ranks from it (copy-on-write; nothing
in the parent has started a thread, a process group or a device yet), each with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free
loopback port) and its stdout/stderr in DIR/rank{r}.log (without --log-dir: this process's own, as
`harness serve` wants for its server log). The worker is `M.main(ARGS)` (the embedded backend's
worker; harness serve: harness.serve.worker). Like torchrun it waits for every rank; the first rank to fail is
named on stdout ("first failure: rank R exited with code C"), the others get SIGTERM (then SIGKILL),
and it exits non-zero; a SIGTERM, SIGINT or SIGHUP it receives is passed on to every rank the same way.

Multi-node launches and CUDA devices keep torchrun (harness/launcher/launch.py decides).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

from harness.launcher.launch import free_port

STOP_GRACE_S = 10.0
FAILURE_LINE = "first failure: rank {rank} exited with code {code}"


def _rank_main(rank: int, world: int, port: int, log_dir: Path | None, module: str, worker_args: list[str]) -> int:
    """In the forked child: torchrun's environment, output to its log, then the worker."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    if log_dir is not None:
        fd = os.open(log_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        code = importlib.import_module(module).main(worker_args)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the traceback goes to the rank's log, as under torchrun
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _stop(pids: Sequence[int]) -> None:
    """SIGTERM the live ranks, then SIGKILL what is left after STOP_GRACE_S."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 0.0)):
        live = [p for p in pids if _alive(p)]
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while live and time.monotonic() < deadline:
            live = [p for p in live if _alive(p)]
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def launch_ranks(world: int, log_dir: Path | None, worker_args: list[str], module: str) -> int:
    """Fork `world` ranks of `module`'s main, wait for them; 0 when all exit 0, else the first failure's code."""
    importlib.import_module(module)  # imported once here, inherited by every rank
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the child never returns into the parent's code
            os._exit(_rank_main(rank, world, port, log_dir, module, worker_args))
        ranks[pid] = rank

    def pass_on(signum: int, _frame: object) -> None:  # installed after the forks: the ranks keep the defaults
        _stop(list(ranks))
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, pass_on)
    first_failure = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            first_failure = code if code > 0 else 128 - code  # killed by signal S: 128 + S, as a shell says
            print(FAILURE_LINE.format(rank=rank, code=code), flush=True)
            _stop(list(ranks))
            for pid in ranks:  # reap what the SIGKILL left
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
            break
    return first_failure


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.launcher.forkrun")
    parser.add_argument("--nproc", type=int, required=True, help="ranks to fork")
    parser.add_argument("--log-dir", type=Path, default=None, help="where rank{r}.log go (default: this stdout)")
    parser.add_argument("--module", required=True, help="the module whose main(args) each rank runs")
    parser.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then the worker's arguments")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    if args.nproc < 1:
        parser.error(f"--nproc={args.nproc} must be >= 1")
    return launch_ranks(args.nproc, args.log_dir, worker_args, args.module)


if __name__ == "__main__":
    sys.exit(main())
