"""`harness bisect --cell ID --good SHA --bad SHA`: the commit that broke one cell, by `git bisect run`.

Takes the arguments of `harness run` (the cell's suite, engine, profile...) and one cell id (as `harness matrix`
prints it). The bisection runs in a temporary worktree of --repo at detached commits (the checkout you work in
is never moved), each step running that one cell:

- --repo-is harness (the default; --repo defaults to this harness's own checkout): the cell runs with the code of
  the commit under test (`python -m harness` from the worktree);
- --repo-is engine (an engine's checkout): --build CMD runs in the worktree first (e.g. "pip install -e ."; a
  failing build skips the commit), then the cell runs with this harness against the engine just built.

A step is good when the cell passes (exit 0), bad when it FAILs (or ERRORs; --error-is skip skips such a
commit), skipped when the commit cannot run the command at all (exit 2). Every step's log and report stay under
--work. Prints the first bad commit; exit 0 when one was found, 3 when not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.cli.run import add_run_arguments, build_request, select_cells
from harness.core.errors import ConfigError, RunError
from harness.core.paths import PROJECT_ROOT
from harness.core.verdict import ExitCode

GOOD, BAD, SKIP = 0, 1, 125  # git bisect run's exit codes
STEP_FILE = "bisect-step.json"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bisect", help="find the commit that broke one cell (git bisect run)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--cell", default=None, metavar="ID", help="the cell that is the test (an id of harness matrix)")
    p.add_argument("--good", default=None, metavar="SHA", help="a commit where the cell passes")
    p.add_argument("--bad", default=None, metavar="SHA", help="a commit where it fails")
    p.add_argument("--repo", type=Path, default=None,
                   help="the git checkout to bisect (default: this harness's own checkout)")
    p.add_argument("--repo-is", choices=("harness", "engine"), default="harness",
                   help="harness: the cell runs with each commit's harness code; engine: with this harness, against "
                   "the engine each commit builds (--build)")
    p.add_argument("--build", default=None, metavar="CMD",
                   help="command run in the checkout before each step (split like a shell would, run without one); "
                   "a failing build skips the commit")
    p.add_argument("--error-is", choices=("bad", "skip"), default="bad",
                   help="what an ERROR cell makes of a commit (default: bad)")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the worktree, each step's log and report (default: a new temporary folder)")
    p.add_argument("--step", type=Path, default=None, help=argparse.SUPPRESS)  # one step, as git bisect run calls it
    p.set_defaults(func=run)


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise ConfigError(f"git {' '.join(args)} in {repo} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return proc


def _commit(repo: Path, rev: str, flag: str) -> str:
    proc = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if proc.returncode != 0:
        raise ConfigError(f"{flag} {rev!r} is not a commit of {repo}")
    return proc.stdout.strip()


def cell_argv(command: str) -> tuple[dict[str, str], list[str]]:
    """A cell's command (`K=V ... harness run ...`) as (its environment, the arguments after `harness`)."""
    words = shlex.split(command)
    env: dict[str, str] = {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[:1] != ["harness"]:
        raise RunError(f"a cell's command does not start with harness: {command!r}")
    return env, words[1:]


def run(args: argparse.Namespace) -> int:
    if args.step is not None:
        return step(args.step)
    for flag in ("cell", "good", "bad"):
        if not getattr(args, flag):
            raise ConfigError(f"--{flag} is required (harness bisect --cell ID --good SHA --bad SHA)")
    repo = (args.repo or PROJECT_ROOT).resolve()
    if _git(repo, "rev-parse", "--show-toplevel", check=False).returncode != 0:
        raise ConfigError(f"--repo {repo} is not a git checkout")
    good, bad = _commit(repo, args.good, "--good"), _commit(repo, args.bad, "--bad")
    if _git(repo, "merge-base", "--is-ancestor", good, bad, check=False).returncode != 0:
        raise ConfigError(f"--good {args.good} is not an ancestor of --bad {args.bad}")
    from harness.flow.runner import Runner
    req = select_cells(build_request(args), args.cell, None)
    if len(req.cells or ()) != 1:
        raise ConfigError(f"--cell {args.cell!r} names {len(req.cells or ())} cells; give one cell id with its "
                          f"workload")
    runner = Runner(req, progress=lambda _: None)
    (cell,) = runner.planned()
    workload = next(w for w in runner.workload_names if runner.wanted(cell, w))
    env, argv = cell_argv(runner.command(cell, workload))
    work = (args.work or Path(tempfile.mkdtemp(prefix="harness-bisect-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = work / "worktree"
    if tree.exists():
        raise ConfigError(f"--work {work} already holds a worktree (an earlier bisection); give another folder")
    spec = {"argv": argv, "env": env, "repo_is": args.repo_is, "build": shlex.split(args.build) if args.build else [],
            "work": str(work), "tree": str(tree), "cache": str(req.cache_dir), "error_is": args.error_is}
    (work / STEP_FILE).write_text(json.dumps(spec, indent=2))
    print(f"bisecting {args.cell} over {repo} ({good[:12]} good .. {bad[:12]} bad) in {tree}", flush=True)
    _git(repo, "worktree", "add", "--detach", str(tree), bad)
    try:
        _git(tree, "bisect", "start", bad, good)
        proc = subprocess.run(["git", "-C", str(tree), "bisect", "run", sys.executable, "-I", "-m", "harness",
                               "bisect", "--step", str(work / STEP_FILE)],
                              capture_output=True, text=True, check=False)
        (work / "bisect-run.log").write_text(proc.stdout + proc.stderr)
        found = re.search(r"^([0-9a-f]{40}) is the first bad commit", proc.stdout, flags=re.M)
        log = _git(tree, "bisect", "log", check=False).stdout
    finally:
        _git(tree, "bisect", "reset", check=False)
        _git(repo, "worktree", "remove", "--force", str(tree), check=False)
    steps = [line for line in log.splitlines() if line.startswith("# ")]
    for line in steps:
        print(f"  {line[2:]}")
    if not found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        print(f"no first bad commit found (git bisect run: {' | '.join(tail)}); logs under {work}")
        return ExitCode.ERROR
    sha = found.group(1)
    subject = _git(repo, "log", "-1", "--format=%s", sha).stdout.strip()
    print(f"first bad commit: {sha} {subject}")
    print(f"step logs and reports: {work}")
    return ExitCode.OK


def step(spec_file: Path) -> int:
    """One bisection step in the worktree at the commit under test: build (engine checkouts), run the cell,
    and answer git bisect run: 0 good, 1 bad, 125 skip."""
    spec = json.loads(spec_file.read_text())
    tree, work = Path(spec["tree"]), Path(spec["work"])
    sha = _git(tree, "rev-parse", "HEAD").stdout.strip()
    out = work / f"step-{sha[:12]}"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, **spec["env"]}
    with open(work / f"step-{sha[:12]}.log", "w") as log:
        if spec["build"]:
            built = subprocess.run(spec["build"], cwd=tree, stdout=log, stderr=subprocess.STDOUT, check=False)
            if built.returncode != 0:
                print(f"{sha[:12]}: build failed (exit {built.returncode}): skipped")
                return SKIP
        cwd = tree if spec["repo_is"] == "harness" else work
        if spec["repo_is"] == "harness":  # the commit's own harness: imported from the worktree
            env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH", "")])])
        argv = [sys.executable, "-m", "harness", *spec["argv"], "--out", str(out), "--cache-dir", spec["cache"]]
        code = subprocess.run(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    answer = {ExitCode.OK: GOOD, ExitCode.FAIL: BAD,
              ExitCode.ERROR: BAD if spec["error_is"] == "bad" else SKIP}.get(code, SKIP)
    print(f"{sha[:12]}: harness exit {code}: {({GOOD: 'good', BAD: 'bad'}).get(answer, 'skip')}")
    return answer
