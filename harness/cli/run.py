"""`harness run`: the matrix of a suite over topologies, compared with the tp1 reference, reported."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.checks.settings import load_suite
from harness.cli.checks import (
    bounded_float,
    bounded_int,
    positive_int,
    require_device,
    require_free_space,
    require_launch_settings,
    require_no_results,
    require_path_lengths,
    require_writable_dir,
    seed_int,
)
from harness.cli.resources import (
    check_cache_budgets,
    machine_memory_bytes,
    require_activation_memory,
    require_weight_memory,
)
from harness.core.errors import ConfigError, DiskFull, RunError
from harness.core.folder_lock import hold_folder
from harness.core.limits import (
    COLLECTIVE_TIMEOUT_S,
    LAUNCH_TIMEOUT_S,
    MAX_KV_BUDGET_MIB,
    MAX_SEQ_LEN,
    MAX_TIMEOUT_S,
    free_bytes,
)
from harness.core.paths import BASELINES_DIR, REPORTS_DIR
from harness.core.verdict import ExitCode
from harness.formats.locate import load_model
from harness.launcher.nodes import NODES_ENV, check_engine, nodes_from_env, parse_nodes
from harness.launcher.orphans import guard_this_process
from harness.records.contract import WORKLOADS, Backend
from harness.records.history import check_store, history_path
from harness.records.shard import parse_shard
from harness.specs.pool import PoolSettings
from harness.specs.suite import Suite, with_profile
from harness.specs.topology import Topology, load_catalog, parse_topology_name
from harness.specs.workload import SUITE_PROMPTS, check_workload_names

if TYPE_CHECKING:  # the engine (and torch) load only when a run is asked for
    from harness.flow.runner import CellPlan, Runner, RunRequest
    from harness.formats.tokenizer import Tokenizer

MIB = 1024 ** 2
SECONDS = bounded_float(MAX_TIMEOUT_S, "seconds")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run a suite over topologies and write a report")
    add_run_arguments(p)
    p.add_argument("--rerun-failed", type=Path, default=None, metavar="RUN_DIR",
                   help="run again only the FAIL, ERROR and not-run cells of RUN_DIR (a run or a merge of shards), "
                   "with its settings; the new report holds every cell of RUN_DIR, each rerun cell showing both "
                   "attempts (a pass on retry is a WARN, never silently green)")
    p.add_argument("--references-only", action="store_true",
                   help="compute every reference and noise run of the (selected, sharded) cells into --cache-dir "
                   "and stop: the first phase of a nightly whose shards then read them")
    p.set_defaults(func=run)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments that say which matrix a run is (`harness run` and `harness matrix` take the same)."""
    p.add_argument("--suite", default="dcp", help="shipped suite name or suite .yaml (default: dcp)")
    p.add_argument("--topo", default=None,
                   help="topology, comma list, set name, or 'all' (default: the suite's topologies)")
    p.add_argument("--model", default=None, help="override the suite's models (name, .yaml, checkpoint, .gguf)")
    p.add_argument("--fault", default=None, help="inject a known bug into the parallel runs (harness list faults)")
    p.add_argument("--seed", type=seed_int, action="append", default=None, help="seed (repeatable; default: suite's)")
    p.add_argument("--workload", action="append", default=None, metavar="NAME[,NAME...]",
                   help="workloads to run (repeatable; harness list workloads; default: the suite's workloads)")
    p.add_argument("--out", type=Path, default=None, help="report folder, new or without a results.json: an earlier "
                   "run's folder is refused, never written over (default: reports/<run-id>)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--kv-budget-mib", type=bounded_int(MAX_KV_BUDGET_MIB, "MiB"), default=None,
                   help="KV pool budget per rank, MiB (default: suite's)")
    p.add_argument("--max-seq-len", type=bounded_int(MAX_SEQ_LEN, "tokens"), default=None,
                   help="tokens per KV sequence slot (default: suite's)")
    p.add_argument("--profile", default=None, help="a profile of the suite (e.g. nightly) overriding its settings")
    p.add_argument("--gsm8k-path", default=None, help="folder with GSM8K test.jsonl/train.jsonl "
                   "(default: $HARNESS_GSM8K_PATH, else the hub through datasets)")
    p.add_argument("--baselines-dir", type=Path, default=BASELINES_DIR,
                   help="stored GSM8K baselines (default: baselines/)")
    p.add_argument("--timeout", type=SECONDS, default=None,
                   help=f"seconds before a launch is killed (default: ${TIMEOUT_ENV} or {LAUNCH_TIMEOUT_S:.0f})")
    p.add_argument("--collective-timeout", type=SECONDS, default=COLLECTIVE_TIMEOUT_S,
                   help="seconds before a collective fails")
    p.add_argument("--list-cells", action="store_true",
                   help="print each cell (x workload) the run would run, and each SKIP decided before launch with its "
                   "reason (the model's split, the engine's capabilities on this machine), then exit: nothing starts")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="reference-run cache, and HTTP engines' HF exports and converted checkpoints (default: "
                   "$HARNESS_CACHE_DIR, else the user's $XDG_CACHE_HOME or ~/.cache /llm-parallel-harness, mode 0700)")
    p.add_argument("--engine-build", default=None, metavar="LABEL",
                   help="label of the engine's build, for one whose version string does not change (a fork, a "
                   "local checkout): keys the reference cache, recorded in each cell, shown in the report, repeated "
                   "by the reproduce command (default: what the engine template's build_argv prints, if any)")
    p.add_argument("--engine", default="embedded",
                   help="backend of the parallel runs: NAME or NAME:OPTION (harness list engines), or an engine "
                   "template file PATH.yaml[:OPTION] (default: embedded)")
    p.add_argument("--reference-engine", default=None,
                   help="backend of the reference runs (default: the same engine at the suite's reference topology)")
    p.add_argument("--shard", default=None, metavar="K/N|env",
                   help="run only share K of N of the matrix (cost-balanced; merge with harness report DIR...); env: "
                   "the share the scheduler's array index names (SLURM_ARRAY_TASK_ID/_COUNT, JOB_COMPLETION_INDEX "
                   "with HARNESS_SHARD_COUNT, BUILDKITE_PARALLEL_JOB/_COUNT)")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--cells", default=None, metavar="ID[,ID...]",
                        help="run only these cells (ids as harness matrix prints them; a launch id without the "
                        "workload means all its workloads)")
    chosen.add_argument("--cells-from", type=Path, default=None, metavar="FILE",
                        help="run only the cells of this suite listed in FILE (harness matrix output); shards then "
                        "balance by its estimated seconds")
    p.add_argument("--gpus", type=positive_int, default=None, metavar="N",
                   help="run only the cells of N GPUs (ranks): one runner class")
    p.add_argument("--history", type=Path, default=None, help="record the run into this history database "
                   "and show each cell's recent runs in the report (default: $HARNESS_HISTORY, else none)")
    p.add_argument("--nnodes", type=nnodes_arg, default=1, help="machines of a multi-node run (default 1); cells "
                   "whose world size divides by it run over all of them; env: the count, this node's rank and node "
                   "0's address from the allocation (Slurm's SLURM_* node list, a JobSet's pod hostnames)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index in a multi-node run "
                   "(0 runs references, compares and writes the report)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="node 0's rendezvous address; the k-th cell uses PORT+k")
    p.add_argument("--attach", action="append", default=None, metavar="TOPO=URL[,TOPO=URL...]",
                   help="HTTP engines: send every run of topology TOPO (a cell's, or the reference's tp1) to the "
                   "server you run at URL instead of starting one; never stopped by the harness (repeatable)")
    servers = p.add_mutually_exclusive_group()
    servers.add_argument("--keep-servers", action="store_true",
                         help="HTTP engines: leave the engine servers up when the run ends (listed in "
                         "CACHE/servers/servers.json); a later run reuses the live ones of its configurations, and a "
                         "run without this flag stops those it used")
    servers.add_argument("--server-per-run", action="store_true",
                         help="HTTP engines: start a fresh server for every run instead of one per engine "
                         "configuration for the whole matrix")


TIMEOUT_ENV = "HARNESS_LAUNCH_TIMEOUT_S"


def nnodes_arg(text: str) -> int | str:
    """--nnodes: a whole number, or env (from the allocation)."""
    if text.strip() == NODES_ENV:
        return NODES_ENV
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a node count nor env") from None


def launch_timeout(flag: float | None) -> float:
    """--timeout, else $HARNESS_LAUNCH_TIMEOUT_S (a test run or a slow box sets it once), else the default."""
    if flag is not None:
        return flag
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return LAUNCH_TIMEOUT_S
    try:
        return SECONDS(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: {exc}") from None


def run_id(suite: str) -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{suite}"


def build_request(args: argparse.Namespace) -> "RunRequest":
    """Resolve and validate everything a run needs; every bad input is one ConfigError, before launching."""
    from harness.backends.registry import get_backend
    from harness.checks.settings import CheckSettings
    from harness.core.paths import default_cache_dir
    from harness.flow.runner import RunRequest
    from harness.formats.tokenizer import load_tokenizer
    from harness.formats.weights import validate_checkpoint
    from harness.gsm8k.data import resolve_source
    from harness.gsm8k.settings import gsm8k_settings
    from harness.specs.speculative import SpeculativeSettings

    suite = with_profile(load_suite(args.suite), args.profile)
    catalog = load_catalog()
    topo_expr = ",".join(suite.topologies) if args.topo is None else args.topo  # --topo "" is an error, not all
    topologies = catalog.resolve(topo_expr, all_names=suite.topologies)
    default_models = suite.models_for(get_backend(args.engine).name)  # with the engine's own (engine_models)
    models = (load_model(args.model),) if args.model else tuple(load_model(m) for m in default_models)
    tokenizers = {}
    for model in models:
        CheckSettings.from_suite(suite, model.dtype)  # a tolerance typo fails here, not after the runs
        validate_checkpoint(model)  # missing/corrupt checkpoint: one error before any rank starts
        tokenizers[model.name] = load_tokenizer(model)
    budget_mib = suite.kv_budget_mib if args.kv_budget_mib is None else args.kv_budget_mib
    max_seq_len = suite.max_seq_len if args.max_seq_len is None else args.max_seq_len
    if budget_mib <= 0 or max_seq_len <= 0:
        raise ConfigError(f"--kv-budget-mib={budget_mib} and --max-seq-len={max_seq_len} must be > 0")
    if budget_mib > MAX_KV_BUDGET_MIB or max_seq_len > MAX_SEQ_LEN:
        raise ConfigError(f"suite {suite.name}: kv_budget_mib={budget_mib} or max_seq_len={max_seq_len} is more than "
                          f"the maximum ({MAX_KV_BUDGET_MIB} MiB, {MAX_SEQ_LEN} tokens)")
    # every cache group of every cell and of the reference, and the reference's weights: before any work
    reference = parse_topology_name(suite.reference).without_speculator()
    check_cache_budgets(models, [*topologies, reference], budget_mib * MIB, max_seq_len)
    require_weight_memory(models)
    require_activation_memory(models, [*topologies, reference], max_seq_len, machine_memory_bytes())
    SpeculativeSettings.from_mapping(suite.speculative, f"suite {suite.name}: speculative")  # fail before launching
    gsm8k = gsm8k_settings(suite.gsm8k, f"suite {suite.name}: gsm8k") if suite.gsm8k else None
    gsm8k_data = None
    if gsm8k is not None:  # resolved here so a bad path is one error before any rank starts
        folder = resolve_source(args.gsm8k_path).folder
        gsm8k_data = str(folder) if folder else None
    out_dir = Path(args.out or REPORTS_DIR / run_id(suite.name))
    cache_dir = args.cache_dir or default_cache_dir()
    require_writable_dir(out_dir, "--out")
    require_no_results(out_dir, "--out")
    require_writable_dir(cache_dir, "--cache-dir")
    history = history_path(args.history)
    if history is not None:  # a store that cannot record is one error now, not after the run
        require_path_lengths(history, "--history")
        require_writable_dir(history.parent, "--history")
        check_store(history)
    require_device(args.device, [t.tp for t in topologies])
    require_launch_settings(dict(os.environ))
    from harness.backends.build import check_label
    # an unknown engine, a bad option, a build label that is none or a template build command that fails:
    # one error before anything runs
    engines = [get_backend(args.engine)]
    if args.reference_engine:
        engines.append(get_backend(args.reference_engine))
    for backend in engines if args.engine_build is None else engines[1:]:
        backend.engine_build()
    workloads = selected_workloads(suite, args.workload)
    runs_workloads = all(e.capabilities().has(WORKLOADS) for e in engines)  # else only the suite's prompts
    check_sequence_lengths(suite, workloads if runs_workloads else (SUITE_PROMPTS,), tokenizers, max_seq_len,
                           PoolSettings().block_size * max((t.dcp for t in topologies), default=1))
    n_cells = len(suite.seeds if not args.seed else args.seed) * len(models) * len(topologies)
    nodes = (nodes_from_env(os.environ, n_cells, launch_timeout(args.timeout)) if args.nnodes == NODES_ENV else
             parse_nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, n_cells, launch_timeout(args.timeout)))
    check_engine(args.engine, nodes)
    return RunRequest(
        engine=args.engine, reference_engine=args.reference_engine,
        reproduce=reproduce_args(args, budget_mib, max_seq_len),
        model_refs=tuple((m.name, _ref(r)) for m, r in zip(models, [args.model] if args.model else default_models)),
        suite=suite, models=models, topologies=tuple(topologies), fault=args.fault,
        seeds=tuple(args.seed) if args.seed else suite.seeds, out_dir=out_dir,
        cache_dir=cache_dir, device=args.device, timeout_s=launch_timeout(args.timeout),
        collective_timeout_s=args.collective_timeout, gsm8k=gsm8k, gsm8k_data=gsm8k_data,
        baselines_dir=args.baselines_dir, shard=parse_shard(args.shard, os.environ) if args.shard else None,
        gpus=args.gpus,
        engine_build=check_label(args.engine_build) if args.engine_build is not None else None,
        nodes=nodes, pool=(("budget_bytes", budget_mib * MIB), ("max_seq_len", max_seq_len)), workloads=workloads,
        keep_servers=args.keep_servers, server_per_run=args.server_per_run,
        attach=attached_servers(args.attach, engines, topologies, suite.reference, tuple(m.name for m in models),
                                max_seq_len))


def select_cells(req: "RunRequest", cells: str | None, cells_from: Path | None) -> "RunRequest":
    """The request restricted to --cells ids or the cells of its suite in a --cells-from list (whose estimates
    the shards then balance by); every id must be a cell of this run (one ConfigError naming it)."""
    from dataclasses import replace

    from harness.flow.runner import Runner
    from harness.records.cells import launch_estimates, parse_ids, read_cells, resolve_ids

    if cells is None and cells_from is None:
        return req
    suite = req.suite.name
    probe = Runner(replace(req, shard=None, cells=None, estimates=(), gpus=None), progress=lambda _: None)
    known = [probe.cell_id(c, w) for c in probe.planned() for w in probe.workload_names]
    estimates: dict[str, float] = {}
    if cells_from is not None:
        rows = read_cells(cells_from)
        mine = [r for r in rows if r.suite == suite]
        if not mine:
            raise ConfigError(f"--cells-from {cells_from} holds no cell of suite {suite} (it lists suites "
                              f"{', '.join(sorted({r.suite for r in rows}))})")
        ids, flag, estimates = [r.id for r in mine], f"--cells-from {cells_from}", launch_estimates(mine)
    else:
        assert cells is not None
        ids, flag = parse_ids(cells), "--cells"
    chosen = resolve_ids(ids, known, flag)
    return replace(req, cells=frozenset(chosen), estimates=tuple(sorted(estimates.items())))


def attached_servers(given: list[str] | None, engines: list[Backend], topologies: Sequence[Topology],
                     reference: str, models: tuple[str, ...] = (), max_seq_len: int = 0) -> tuple[tuple[str, str], ...]:
    """--attach TOPO=URL items (comma lists, repeatable) validated: TOPO a topology the run serves (a cell's, the
    plain one of a -draft / -mtp cell, or the reference's), URL http(s)://, an engine that starts servers, and the
    server there answering and serving `models` at TOPO with at least `max_seq_len` tokens (probe_attached)."""
    from harness.backends.http.attached import probe_attached
    from harness.backends.http.backend import HttpBackend

    items = [i.strip() for g in given or [] for i in g.split(",") if i.strip()]
    if not items:
        return ()
    if not any(isinstance(e, HttpBackend) and e.spec.argv for e in engines):
        raise ConfigError(f"--attach {items[0]}: engine {engines[0].name} starts no HTTP server to attach in its "
                          f"place (use an HTTP engine: --engine vllm, sglang, harness-serve)")
    ref = parse_topology_name(reference).without_speculator()
    served = {ref.name} | {n for t in topologies for n in (t.name, t.without_speculator().name)} | {
        f"{ref.name}-{t.speculator}" for t in topologies if t.speculator != "none"}
    out: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name.strip() or not url.strip():
            raise ConfigError(f"--attach {item!r} is not TOPO=URL (e.g. tp2=http://127.0.0.1:8001)")
        name, url = name.strip(), url.strip().rstrip("/")
        if name not in served:
            raise ConfigError(f"--attach {item!r}: this run serves no topology {name!r}; it serves "
                              f"{', '.join(sorted(served))}")
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
            raise ConfigError(f"--attach {item!r}: the URL must be http(s)://HOST[:PORT], got {url!r}")
        if name in out and out[name] != url:
            raise ConfigError(f"--attach names topology {name} twice ({out[name]} and {url})")
        out[name] = url
    health = next((e.spec.health for e in engines if isinstance(e, HttpBackend)), "/health")
    for name, url in out.items():  # a server that is not there, or serves something else: exit 2 before any work
        why = probe_attached(name, url, health, models, max_seq_len)
        if why is not None:
            raise ConfigError(f"--attach {name}={url}: {why}; start the server first, or attach the right one")
    return tuple(sorted(out.items()))


def selected_workloads(suite: Suite, given: list[str] | None) -> tuple[str, ...]:
    """--workload names (comma lists, repeatable) validated, else the suite's."""
    return (check_workload_names("--workload", [n.strip() for g in given for n in g.split(",") if n.strip()])
            if given else suite.workloads)


def check_sequence_lengths(suite: Suite, workloads: tuple[str, ...], tokenizers: dict[str, "Tokenizer"],
                           max_seq_len: int, hash_block: int = 0) -> None:
    """The longest sequence of the run (a prompt's own tokens, shared prefix included, + the tokens it
    generates), over every model's tokenizer and every workload it runs, must fit a KV slot (max_seq_len)."""
    from harness.cases import build_workload_cases
    from harness.specs.workload import WorkloadPlan

    plan = WorkloadPlan(suite.resolved_workloads(workloads, hash_block))
    longest = (0, "", "", 0)  # (tokens, workload, model, generated)
    for model, tokenizer in tokenizers.items():
        for group in build_workload_cases(plan, suite.prompts, tokenizer, 0, suite.decode_prefix_tokens):
            tokens = max((len(c.sequence_ids) for c in group.cases), default=0)
            longest = max(longest, (tokens, group.workload.name, model, group.workload.new_tokens))
    tokens, name, model, generated = longest
    if tokens > max_seq_len:
        raise ConfigError(f"the longest sequence of this run is {tokens} tokens (workload {name}, model {model}: "
                          f"a {tokens - generated}-token prompt + {generated} generated), over "
                          f"max_seq_len={max_seq_len}; raise --max-seq-len (or the suite's max_seq_len, or "
                          f"lower its long_context)")


def _ref(ref: str) -> str:
    """A suite or model as given, absolute when it is a path (so the command works from any folder)."""
    path = Path(ref)
    by_path = "/" in ref or path.suffix != ""  # shipped names have neither
    return str(path.resolve()) if by_path and path.exists() else ref


def _engine_ref(engine: str) -> str:
    """NAME[:OPTION] with a NAME (an engine template's path) or an OPTION that is an existing path made absolute."""
    name, sep, option = engine.partition(":")
    name = _ref(name)
    return f"{name}:{_ref(option)}" if sep and option else name


def reproduce_args(args: argparse.Namespace, budget_mib: int, max_seq_len: int) -> tuple[str, ...]:
    """The flags every cell's reproduce command repeats: what decides its verdicts besides the cell."""
    out = ["--suite", _ref(args.suite)]
    if args.profile:
        out += ["--profile", args.profile]
    out += ["--kv-budget-mib", str(budget_mib), "--max-seq-len", str(max_seq_len)]
    if args.engine != "embedded":
        out += ["--engine", _engine_ref(args.engine)]
    if args.reference_engine:
        out += ["--reference-engine", _engine_ref(args.reference_engine)]
    if args.engine_build is not None:
        out += ["--engine-build", args.engine_build.strip()]
    if args.device != "cpu":
        out += ["--device", args.device]
    if args.gsm8k_path:
        out += ["--gsm8k-path", _ref(args.gsm8k_path)]
    if Path(args.baselines_dir).resolve() != BASELINES_DIR.resolve():
        out += ["--baselines-dir", _ref(str(args.baselines_dir))]
    if args.timeout is not None:  # a cell that timed out times out again the same way
        out += ["--timeout", f"{args.timeout:g}"]
    if args.collective_timeout != COLLECTIVE_TIMEOUT_S:
        out += ["--collective-timeout", f"{args.collective_timeout:g}"]
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    from harness.cli.signals import exit_status, interrupt_on_signals
    from harness.core.errors import Interrupted
    from harness.core.paths import cache_dir_given

    with interrupt_on_signals(), cache_dir_given(args.cache_dir):  # --cache-dir holds exports too
        try:
            return _run(args)
        except Interrupted as exc:  # before the matrix ran (the run itself reports what finished)
            print(f"harness: {exc}; no report written", file=sys.stderr, flush=True)
            return exit_status(exc)


def list_cells(runner: "Runner", planned: "Sequence[CellPlan]") -> str:
    """--list-cells: one line per cell and workload, "runs" or "SKIP: why" as decided before any launch, then the
    attention backend the engine runs each model with on this machine (where the template says)."""
    lines = []
    for cell in planned:
        skipped = {} if cell.skip_reason else runner.skipped_workloads(cell)
        for name in runner.workload_names:
            why = cell.skip_reason or skipped.get(name)
            lines.append(f"{cell.slug} {name}: {'SKIP: ' + why if why else 'runs'}")
    lines += [f"attention backend ({model}): {r['attention']} on {r['backend']} ({r['chosen_by']})"
              for model, r in runner.machine_backends().items()]
    runs = sum(1 for line in lines if line.endswith(": runs"))
    return "\n".join([*lines, f"{runs} of {len(planned) * len(runner.workload_names)} cells run"])


def _run(args: argparse.Namespace) -> int:
    from harness.flow.runner import Runner, plan_cells

    guard_this_process()  # every process this run starts from here on dies with it, however it ends
    if args.rerun_failed is not None:
        return rerun_failed(args)
    req = select_cells(build_request(args), args.cells, args.cells_from)
    every = plan_cells(req)
    # nothing would run: an explicit request that cannot work (an engine's known incompatibility is a SKIP instead:
    # the report says what the engine cannot run and why)
    if all(c.skip_reason for c in every) and not any(c.engine_skip for c in every):
        raise ConfigError(every[0].skip_reason or "no cell to run")
    runner = Runner(req, progress=lambda line: print(line, flush=True))
    if args.list_cells:
        print(list_cells(runner, every))
        return ExitCode.OK
    planned = runner.planned()
    if not planned:  # more shares than launches, or a runner class without cells: nothing to do here
        why = f"shard {req.shard}" if req.shard else f"--gpus {req.gpus}" if req.gpus else "the selection"
        print(f"{why}: no cell of this run to run here; no report written")
        return ExitCode.OK
    if args.references_only:
        with runner.servers.session():
            ready, failed = runner.prepare_references()
        print(f"references: {ready} ready in {req.cache_dir}" + (f", {failed} failed" if failed else ""))
        return ExitCode.ERROR if failed else ExitCode.OK
    require_free_space(req.out_dir, "--out", sum(1 for c in planned if not c.skip_reason))
    if req.nodes is not None and req.nodes.node_rank > 0:  # lends its ranks; node 0 writes the report
        return runner.follow()
    # the folder is this run's until it ends: a second run or a `harness report` into it is refused naming this one
    with hold_folder(req.out_dir, shlex.join(["harness", *args.argv])):
        require_no_results(req.out_dir, "--out")  # again, under the lock: a run that finished meanwhile
        return _run_matrix(args, req, runner)


def _run_matrix(args: argparse.Namespace, req: "RunRequest", runner: "Runner") -> int:
    from harness.cli.signals import exit_status
    from harness.core.errors import Interrupted
    from harness.flow.refcache import partial_dirs
    from harness.records.results import exit_code
    from harness.report import render_all
    from harness.report.text import print_matrix

    start = time.time()
    try:
        cells = runner.run()
    except Interrupted as exc:  # every launch is stopped by now; keep what finished, drop half-written cache
        for staging in partial_dirs(req.cache_dir, os.getpid()):
            shutil.rmtree(staging, ignore_errors=True)
        cells, stopped = stopped_cells(runner, f"interrupted by {exc.name} before this cell finished", signal=exc.name)
        paths = render_all(req.out_dir, cells, {**runner.provenance(args.argv), "interrupted": stopped},
                           req.out_dir.name)
        print(f"harness: {exc} after {stopped['cells_finished']} of {stopped['cells_planned']} cells; report of "
              f"those (the cells not run listed as such): {paths['html']}", file=sys.stderr, flush=True)
        return exit_status(exc)
    except DiskFull as exc:  # the cells done keep their verdicts: on screen, and in the report if it fits
        for staging in partial_dirs(req.cache_dir, os.getpid()):
            shutil.rmtree(staging, ignore_errors=True)
        cells, stopped = stopped_cells(runner, "the disk filled up before this cell finished",
                                       reason="no space left on device")
        print(print_matrix(cells))
        written = write_reports(req.out_dir, cells, {**runner.provenance(args.argv), "interrupted": stopped})
        where = f"report of those: {written['html']}" if isinstance(written, dict) else \
            f"no report written ({written.strerror})"
        raise RunError(f"{exc}; the {stopped['cells_finished']} cell(s) done of {stopped['cells_planned']} keep "
                       f"their verdicts (above; the others are listed as not run); {where}") from None
    written = write_reports(req.out_dir, cells, runner.provenance(args.argv))
    if not isinstance(written, dict):
        print(print_matrix(cells))
        raise RunError(f"cannot write the report into {req.out_dir}: {written.strerror} "
                       f"({free_bytes(req.out_dir)} bytes free); the verdicts are above")
    paths = written
    record_history(args.history, req.out_dir, cells, runner.provenance(args.argv), req.out_dir.name)
    print(print_matrix(cells))
    print(f"report: {paths['html']} ({time.time() - start:.1f} s)")
    return exit_code(cells)


def stopped_cells(runner: "Runner", why: str, **by: str) -> tuple[list[Any], dict[str, Any]]:
    """A stopped run's cells (those finished, then every other planned one listed as not run with `why`) and
    its provenance "interrupted" entry (`by`: the signal or the reason; how many cells finished of how many)."""
    done = list(runner.finished)
    missing = runner.not_run(why)
    return done + missing, {**by, "cells_finished": len(done), "cells_planned": len(done) + len(missing)}


def write_reports(out_dir: Path, cells: list[Any], provenance: dict[str, Any]) -> "dict[str, Path] | OSError":
    """render_all, or the OSError that stopped it (a full disk). Each report file is written atomically,
    so what is on disk is complete: the files written before the error, none after it."""
    from harness.report import render_all
    try:
        return render_all(out_dir, cells, provenance, out_dir.name)
    except OSError as exc:
        return exc


def record_history(given: Path | None, out_dir: Path, cells: list[Any], provenance: dict[str, Any],
                   run_id: str) -> None:
    """With a history store (--history or $HARNESS_HISTORY): record the run, re-render its page with the strips."""
    from harness.records.history import histories_for, history_path
    from harness.report.html import write_html
    path = history_path(given)
    if path is not None:
        write_html(out_dir, cells, provenance, run_id, histories_for(path, cells, record=out_dir))
        print(f"history: recorded into {path}")


def _matrix_command(command: Any) -> list[str] | None:
    """A recorded `harness run` command as its arguments without --out and --shard (what says which matrix and
    settings it ran, whichever share and folder); None for anything else."""
    import shlex
    argv = shlex.split(command) if isinstance(command, str) else []
    if argv[:2] != ["harness", "run"]:
        return None
    out, skip = [], False
    for word in argv[2:]:
        if skip:
            skip = False
        elif word in ("--out", "--shard"):
            skip = True
        elif not word.startswith(("--out=", "--shard=")):
            out.append(word)
    return out


def rerun_failed(args: argparse.Namespace) -> int:
    """--rerun-failed RUN_DIR: the FAIL, ERROR and not-run cells of RUN_DIR (a run, or a merge of shards and suites)
    run again with the settings of the command that ran them (a single run's share kept, the selection kept),
    merged with the other cells into a new report."""
    from dataclasses import replace

    from harness.flow.runner import Runner
    from harness.records.rerun import merge_attempts, to_rerun
    from harness.records.results import exit_code, read_results
    from harness.report.text import print_matrix

    first_dir: Path = args.rerun_failed
    first, provenance, first_id = read_results(first_dir)
    sources = provenance.get("sources") if isinstance(provenance.get("sources"), list) else None
    runs = [s.get("provenance", {}) for s in sources if isinstance(s, dict)] if sources else [provenance]
    commands: dict[tuple[str, ...], str | None] = {}
    for prov in runs:
        argv = _matrix_command(prov.get("command"))
        if argv is None:
            raise ConfigError(f"--rerun-failed {first_dir}: a run it holds was not made by `harness run` "
                              f"(its command: {prov.get('command')!r})")
        commands[tuple(argv)] = None if sources else prov.get("shard")  # a single run keeps its share
    parser = argparse.ArgumentParser(prog="harness run", add_help=False)
    add_run_arguments(parser)
    again: list[Any] = []
    rerun_ids: list[str] = []
    runner = None
    out_dir = Path(args.out or REPORTS_DIR / run_id("rerun"))
    require_no_results(out_dir, "--out")
    for n, (argv, share) in enumerate(commands.items()):
        old, _ = parser.parse_known_args(list(argv))  # flags of a rerun itself (--rerun-failed) are not the matrix's
        # several commands (suites) run into folders of their own: their run folders would share names
        old.out = out_dir if len(commands) == 1 else out_dir / "reruns" / f"{n + 1}-{Path(old.suite).stem}"
        old.history, old.shard, old.argv = None, share, args.argv
        if args.cache_dir is not None:
            old.cache_dir = args.cache_dir
        req = select_cells(build_request(old), old.cells, old.cells_from)
        probe = Runner(req, progress=lambda _: None)
        planned = [probe.cell_id(c, w) for c in probe.planned() for w in probe.workload_names
                   if probe.wanted(c, w)]
        ids = [i for i in to_rerun([c for c in first if c.suite == req.suite.name], planned) if i in set(planned)]
        if not ids:
            continue
        print(f"rerunning {len(ids)} cell(s) of {first_dir} ({first_id}): {', '.join(ids)}", flush=True)
        runner = Runner(replace(req, cells=frozenset(ids), estimates=()), progress=lambda line: print(line, flush=True))
        again += runner.run()
        rerun_ids += ids
    if runner is None:
        print(f"nothing to rerun: no cell of {first_dir} failed, errored or was not run")
        return ExitCode.OK
    cells = merge_attempts(first, again)
    provenance = {**runner.provenance(args.argv), "rerun_of": {"dir": str(first_dir.resolve()), "run_id": first_id,
                                                               "cells": rerun_ids}}
    written = write_reports(out_dir, cells, provenance)
    print(print_matrix(cells))
    if not isinstance(written, dict):
        raise RunError(f"cannot write the report into {out_dir}: {written.strerror}; the verdicts are above")
    record_history(args.history, out_dir, cells, provenance, out_dir.name)
    print(f"report: {written['html']} ({len(rerun_ids)} cell(s) rerun; every attempt in each one's `rerun` check)")
    return exit_code(cells)
