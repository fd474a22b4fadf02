"""The matrix flow, written once: plan cells -> reference runs (cached) -> one launch per cell ->
compare -> CellResults. Stages talk through run directories (harness/records/artifacts.py)."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import threading
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from harness.arch.component import PlanError
from harness.arch.components import Speculator
from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.backends.base import backend_record
from harness.backends.build import LabelledBackend, with_build
from harness.backends.embedded.backend import EmbeddedBackend
from harness.backends.http.pool import STATE_FILE, ServerPool, server_need
from harness.backends.registry import DEFAULT_ENGINE, get_backend
from harness.checks.context import CellContext, CellInfo
from harness.checks.driver import run_checks
from harness.checks.settings import CheckSettings
from harness.compare.parity.jumps import JumpEvidence, pooled
from harness.compare.parity.noise_source import NoiseRuns, measures_nothing
from harness.compare.parity.schedule import engine_evidence
from harness.core.errors import ConfigError, DiskFull, HarnessError, RunError
from harness.core.limits import COLLECTIVE_TIMEOUT_S, LAUNCH_TIMEOUT_S, RUN_DIR_MIN_BYTES, free_bytes
from harness.core.paths import BASELINES_DIR
from harness.core.verdict import NOT_RUN_CHECK, CellResult, CheckResult, ExitCode, Verdict
from harness.engine.fault_scope import inert_reason
from harness.engine.faults import FAULTS, LOAD_CONDITIONS, PERTURBATIONS, SHARED_JOIN, fault_flags
from harness.flow.refcache import ReferenceCache, ReferenceFailed
from harness.formats.tokenizer import Tokenizer, load_tokenizer
from harness.gsm8k.settings import GSM8KSettings
from harness.launcher.launch import THREAD_VARS, THREADS_ENV, stop_all_launches
from harness.launcher.nodes import NodeLaunch, Nodes
from harness.records.artifacts import RunArtifacts, run_capabilities
from harness.records.cells import cell_id, launch_id
from harness.records.contract import (
    NOISE_NONE,
    NOISE_PRECISION_TWIN,
    NOISE_REDUCTION_ORDER,
    SCHEDULE_SEQUENTIAL,
    WORKLOADS,
    Backend,
    GSM8KJob,
    Job,
    LaunchResult,
)
from harness.records.shard import Shard, select, shard_cells
from harness.records.validate import load_run, validate_artifacts
from harness.records.workload_views import Views, workload_views
from harness.report.merge import cell_key
from harness.report.provenance import collect_provenance, git_commit
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from harness.specs.suite import Suite
from harness.specs.topology import Topology, parse_topology_name
from harness.specs.workload import SUITE_PROMPTS, Workload

# The noise run: what a correct run may differ from the reference by. Like with like: the reference
# topology in the model's own dtype, with another reduction order (split partial sums, keys merged
# by LSE), so a half-precision model is measured against half-precision noise, not a float64 twin.
NOISE_PERTURBATION = "noise-reduction-order"
NOISE_DTYPE = {"float32": "float64", "bfloat16": "float32", "float16": "float32"}  # precision-twin backends


def noise_run(model: ModelSpec) -> tuple[str, str | None]:
    """(dtype, engine perturbation) of `model`'s noise run under contract.NOISE_REDUCTION_ORDER (the
    embedded engine's strategy): same precision, another reduction order."""
    return model.dtype, NOISE_PERTURBATION


@dataclass(frozen=True)
class RunRequest:
    """What `harness run` was asked to do, resolved and validated."""

    suite: Suite
    models: tuple[ModelSpec, ...]
    topologies: tuple[Topology, ...]
    fault: str | None
    seeds: tuple[int, ...]
    out_dir: Path
    cache_dir: Path
    device: str = "cpu"
    timeout_s: float = LAUNCH_TIMEOUT_S
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    pool: tuple[tuple[str, int], ...] = ()
    gsm8k: GSM8KSettings | None = None
    gsm8k_data: str | None = None
    baselines_dir: Path = BASELINES_DIR
    engine: str = DEFAULT_ENGINE               # backend of the parallel runs (NAME or NAME:OPTION)
    reference_engine: str | None = None        # backend of the reference runs (default: engine)
    reproduce: tuple[str, ...] = ()            # argv (after "harness run") that every cell command repeats
    model_refs: tuple[tuple[str, str], ...] = ()  # model name -> how to name it again (path when given by path)
    engine_build: str | None = None            # the parallel engine's build label (--engine-build)
    workloads: tuple[str, ...] = ()            # the workloads to run (--workload; empty: the suite's list)

    @property
    def ref_engine(self) -> str:
        return self.reference_engine or self.engine
    shard: Shard | None = None  # run only this share of the cells (harness/records/shard.py)
    nodes: Nodes | None = None  # this machine's place in a multi-node run (harness/launcher/nodes.py)
    keep_servers: bool = False  # leave HTTP engines' servers up for later runs (harness/backends/http/pool.py)
    server_per_run: bool = False  # a fresh HTTP engine server for every run (no server serves two runs)
    attach: tuple[tuple[str, str], ...] = ()  # topology name -> the URL of a server the user runs (--attach)
    cells: frozenset[str] | None = None  # run only these cell ids (--cells, --cells-from; harness/records/cells.py)
    estimates: tuple[tuple[str, float], ...] = ()  # launch id -> estimated seconds, what shards balance by
    gpus: int | None = None  # run only the cells of this many GPUs (--gpus: one runner class)


@dataclass(frozen=True)
class CellPlan:
    model: ModelSpec
    topology: Topology
    fault: str | None
    seed: int
    skip_reason: str | None
    engine_skip: bool = False  # the skip is an engine's known incompatibility (a capability), not the plan's

    @property
    def slug(self) -> str:
        return f"{self.model.name}/{self.topology.name}{'-' + self.fault if self.fault else ''}/seed{self.seed}"


class Beside:
    """`fn(*args)` run in a daemon thread from now on; `result()` waits for it and returns its value or raises its
    exception. A caller that leaves without asking (an interrupt) does not wait: the thread dies with the process,
    and what it launched is stopped as any launch is when the harness exits."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # handed to result()
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def seeded(model: ModelSpec, seed: int, reseeds: bool = True) -> ModelSpec:
    """The model a run of `seed` runs: with `reseeds` (every engine of the run reseeds weights by the run seed,
    Backend.reseeds_weights) a synthetic model's weights are reseeded, so seeds cover other models, not only other
    prompts; otherwise the model's own weights (its spec's seed), and the seed seeds the cases and requests."""
    return replace(model, seed=model.seed + seed) if reseeds and model.source == "synthetic" else model


def skip_reason(model: ModelSpec, topo: Topology, fault: str | None) -> str | None:
    """Why a cell cannot run (model does not split, fault does not apply), or None."""
    speculator_error: PlanError | None = None
    try:
        plan_model(model_of(model), topo)
    except PlanError as exc:
        if exc.component != Speculator.name:
            return f"{model.name} does not split at {topo.name}: {exc}"
        speculator_error = exc
    if topo.speculator != "none" and model.speculator_layers > model.layers:
        return f"{model.name}: speculator_layers={model.speculator_layers} exceeds layers={model.layers}"
    if speculator_error is not None:
        return f"{model.name}'s speculator does not split at {topo.name}: {speculator_error}"
    if fault:
        try:
            fault_flags(fault, topo)
        except ConfigError as exc:
            return str(exc)
        return inert_reason(fault, model, topo)
    return None


def _engine_skip(model: ModelSpec, topo: Topology, backend: Backend, ref_backend: Backend,
                 reference: Topology) -> str | None:
    """Why the parallel engine cannot run the cell or the reference engine its reference, or None."""
    if topo.prefill is not None and not getattr(backend, "disaggregated", False):
        return (f"engine {backend.name} runs no disaggregated topology ({topo.name}); the embedded engine does "
                f"(--engine embedded)")
    why = backend.skip_reason(model, topo)
    if why:
        return f"engine {backend.name}: {why}"
    ref_topo = Topology(tp=reference.tp, dcp=reference.dcp, speculator=topo.speculator)
    why = ref_backend.skip_reason(model, ref_topo)
    return f"reference engine {ref_backend.name}: {why}" if why else None


def plan_cells(req: RunRequest, backends: tuple[Backend, Backend] | None = None) -> list[CellPlan]:
    """Every cell of the request with its skip reason; `backends` (parallel, reference) default to
    the request's engines."""
    if req.fault and req.fault not in FAULTS and req.fault not in LOAD_CONDITIONS:
        fault_flags(req.fault, Topology(tp=1))  # raises the did-you-mean error
    backend, ref_backend = backends or (get_backend(req.engine), get_backend(req.ref_engine))
    reference = parse_topology_name(req.suite.reference).without_speculator()
    out = []
    for m in req.models:
        for seed in req.seeds:
            for t in req.topologies:
                planned = skip_reason(m, t, req.fault)
                engine = None if planned else _engine_skip(m, t, backend, ref_backend, reference)
                out.append(CellPlan(m, t, req.fault, seed, planned or engine, engine_skip=engine is not None))
    return out



def _jump_evidence(views: Views, workloads: Sequence[Workload]) -> JumpEvidence | None:
    """The reference engine's jumps under rounding alone (schedule.engine_evidence), pooled over the views of the
    greedy workloads (a sampled workload's tokens are draws: their differences are not rounding's); None where no
    view holds usable generations."""
    greedy = {w.name for w in workloads if w.sampling is None}
    found = []
    for name, (ref, _, noise, against) in views.items():
        if name not in greedy:
            continue
        try:
            found.append(engine_evidence(ref if against is None else against, noise))
        except RunError:  # no usable generations in this view: the checks say so themselves
            continue
    return pooled(found) if found else None

class Runner:
    """Runs a matrix; the reference (and its noise-floor twin) is launched once per (model, seed)."""

    def __init__(self, req: RunRequest, progress: Callable[[str], None] = print) -> None:
        self.req = req
        said = threading.Lock()  # a reference and its noise run may report from two threads: a line at a time

        def say(line: str) -> None:
            with said:
                progress(line)

        self.progress = say
        self._refs: dict[tuple[str, int, str], tuple[RunArtifacts, NoiseRuns]] = {}
        self.reference_topology = parse_topology_name(req.suite.reference).without_speculator()
        self._commit = git_commit()
        self._failed_refs: dict[tuple[str, int, str], ReferenceFailed] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        self.backend = with_build(get_backend(req.engine), req.engine_build)  # the parallel runs
        # the reference and its noise twin: the same build when they run on the same engine
        self.ref_backend = with_build(get_backend(req.ref_engine).as_reference(),
                                      req.engine_build if req.ref_engine == req.engine else None)
        self.cache = ReferenceCache(req.cache_dir, self.ref_backend, req.timeout_s, self.progress)
        # the embedded engine's runs on the same checkpoint, where the reference engine's noise run measures nothing
        self.noise_cache = ReferenceCache(req.cache_dir, EmbeddedBackend(), req.timeout_s, self.progress)
        # a run seed reseeds synthetic weights only where both engines do (the reference's weights are the cell's)
        self.reseeds = self.backend.reseeds_weights() and self.ref_backend.reseeds_weights()
        self.finished: list[CellResult] = []  # the cells done so far (what an interrupted run reports)
        # HTTP engines' servers: one per engine configuration for the whole run (kept: in the cache folder)
        kept = req.cache_dir / "servers"
        folder = None if req.server_per_run else kept if req.keep_servers else req.out_dir / "servers"
        self.servers = ServerPool(folder, keep=req.keep_servers, state_file=kept / STATE_FILE, seeds=req.seeds,
                                  attach=dict(req.attach))

    def job(self, model: ModelSpec, topo: Topology, fault: str | None, seed: int, out_dir: Path,
            dtype: str | None = None) -> Job:
        s, req = self.req.suite, self.req
        perturbed = (fault or "").split(SHARED_JOIN)[0] in PERTURBATIONS
        noise = perturbed or dtype not in (None, model.dtype)  # the noise run skips GSM8K
        gsm8k = (GSM8KJob(req.gsm8k.to_dict(), req.gsm8k_data)
                 if req.gsm8k is not None and not noise else None)
        return Job(model=seeded(model, seed, self.reseeds), topology=topo, prompts=tuple(s.prompts),
                   out_dir=str(out_dir), fault=fault, dtype=dtype, seed=seed, max_new_tokens=s.max_new_tokens,
                   decode_prefix_tokens=s.decode_prefix_tokens, pool=PoolSettings.from_dict(dict(req.pool)),
                   device=req.device, collective_timeout_s=req.collective_timeout_s, git_commit=self._commit,
                   gsm8k=gsm8k,
                   speculative=(SpeculativeSettings.from_mapping(s.speculative) if topo.speculator != "none"
                                else None),
                   workloads=self.workloads if self.workload_names != (SUITE_PROMPTS,) else ())

    @property
    def workloads(self) -> tuple[Workload, ...]:
        """The workloads every cell runs (one launch holds them all), resolved; only the suite's prompts
        when an engine of the run does not run workloads (contract.WORKLOADS)."""
        if not all(b.capabilities().has(WORKLOADS) for b in (self.backend, self.ref_backend)):
            return self.req.suite.resolved_workloads((SUITE_PROMPTS,))
        return self.req.suite.resolved_workloads(self.req.workloads or None, self.hash_block)

    @property
    def hash_block(self) -> int:
        """Tokens of one prefix-cache hash block at the run's largest dcp (block_size x dcp): the workloads are
        sized to it, so every cell of the run (and its reference) sends the same cases."""
        block = int(dict(self.req.pool).get("block_size", PoolSettings().block_size))
        return block * max((t.dcp for t in self.req.topologies), default=1)

    @property
    def workload_names(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.workloads)

    def skipped_workloads(self, cell: CellPlan) -> dict[str, str]:
        """The workloads the parallel engine cannot run at the cell's topology (Backend.workload_skip), each with
        why: decided before any launch, they are SKIP cells and its run leaves them out."""
        out = {}
        for w in self.workloads:
            why = self.backend.workload_skip(cell.topology, w)
            if why:
                out[w.name] = f"engine {self.backend.name}: {why}"
        return out

    def cell_workloads(self, cell: CellPlan) -> tuple[Workload, ...]:
        """The workloads the cell's run holds (every workload but the skipped ones)."""
        skipped = self.skipped_workloads(cell)
        return tuple(w for w in self.workloads if w.name not in skipped)

    def workload_skips(self, cell: CellPlan) -> list[CellResult]:
        """One SKIP result for each workload the parallel engine cannot run at the cell's topology."""
        return [CellResult(**{**self._identity(cell), "workload": w, "command": self.command(cell, w)},
                           checks=(CheckResult("cell", Verdict.SKIP, why),), clean_exit=True)
                for w, why in self.skipped_workloads(cell).items()]

    def per_workload(self, cell: CellPlan, result: CellResult) -> list[CellResult]:
        """A launch's result (a SKIP or ERROR before any check ran) as one cell per workload it held, and a SKIP for
        each workload the engine cannot run there."""
        return [replace(result, workload=w.name, command=self.command(cell, w.name))
                for w in self.cell_workloads(cell)] + self.workload_skips(cell)

    def _cached(self, model: ModelSpec, seed: int, dtype: str, topo: Topology, repeat: bool = False,
                perturbation: str | None = None, fault: str | None = None,
                cache: ReferenceCache | None = None, purpose: str = "") -> RunArtifacts:
        """A reference-topology run of `model` in `dtype` on the reference engine (or `cache`'s), from the
        content-keyed cache (harness/flow/refcache.py) or launched now; `repeat` is a second, independent run
        of the same job; `perturbation` an engine perturbation of the reduction order (the noise run); `purpose`
        is said in its progress line."""
        cache = cache or self.cache
        job = self.job(model, topo, perturbation or fault, seed, Path("."), dtype)
        if repeat:  # the scheduling-noise twin: the same cases sent one at a time (GSM8K is not noise)
            job = replace(job, schedule=SCHEDULE_SEQUENTIAL, gsm8k=None)
        noise = perturbation or repeat or dtype != model.dtype  # the noise run, by any strategy
        label = (f"{'noise' if noise else 'reference'} {model.name} {topo.name} {dtype} seed {seed}"
                 + (f" ({cache.backend.name})" if cache.backend.name != DEFAULT_ENGINE or cache is not self.cache
                    else "")
                 + (", cases sent one at a time" if repeat else "")
                 + (f" with shared fault {fault}" if fault else "") + (f", {purpose}" if purpose else ""))
        name = (f"{model.name}-{topo.name}-{dtype}{'-r' if repeat else ''}"
                f"{'-' + (perturbation or fault) if perturbation or fault else ''}")
        return cache.get(job, name, label, repeat)

    def references(self, model: ModelSpec, seed: int, speculator: str = "none",
                   fault: str | None = None) -> tuple[RunArtifacts, NoiseRuns]:
        """The reference (the suite's reference topology with the cell's speculator) and its noise-floor
        run (same topology and dtype, another reduction order, no speculator; see noise_run), or where that run
        measures nothing the embedded engine's pair on the same checkpoint (_noise_of). A failed reference
        is launched once: later cells get the same ReferenceFailed. A failed twin leaves the tolerance floors in charge.
        A fault in code the reference runs too (Fault.shared) is injected into the reference as well."""
        topo, shared = self._reference_of(speculator, fault)
        key = self._reference_key(model, seed, speculator, fault)
        if key in self._failed_refs:
            raise self._failed_refs[key]
        if key not in self._refs:
            # the noise run beside the reference where the engine's runs are independent (each launch its own
            # processes: the reference's one rank leaves cores idle), else after it
            noise = (Beside(self._noise_run, model, seed, self.reference_topology, shared)
                     if self.ref_backend.independent_runs() else None)
            try:
                ref = self._cached(model, seed, model.dtype, topo, fault=shared)
            except ReferenceFailed as exc:
                self._failed_refs[key] = exc
                raise
            except BaseException:  # interrupted: the noise run beside it must not outlive the run
                if noise is not None:
                    stop_all_launches()
                raise
            twin = (noise.result() if noise is not None
                    else self._noise_run(model, seed, self.reference_topology, shared))
            self._refs[key] = (ref, self._noise_of(model, seed, ref, twin, shared))
        return self._refs[key]

    def _noise_of(self, model: ModelSpec, seed: int, ref: RunArtifacts, twin: RunArtifacts | None,
                  shared: str | None) -> NoiseRuns:
        """The noise a cell's bounds scale from: the reference engine's own noise run `twin`, unless it measures
        nothing (absent, failed, or bit-identical to the reference: compare/noise_source.measures_nothing) on an
        engine other than the embedded one. Then the embedded engine's reference-topology run and its
        reduction-order noise run of the same checkpoint, in the model's dtype (cached like any reference), where
        it runs the model; where it does not, `twin` as it is (the floors), and the source says why."""
        base = self.reference_topology
        why = None if _embedded(self.ref_backend) else measures_nothing(ref, twin)
        if why is None:
            return NoiseRuns(twin)
        own = f"{self.ref_backend.name}'s {self.ref_backend.noise_strategy()} noise run was {why}"
        refused = skip_reason(model, base, None) or self.noise_cache.backend.skip_reason(model, base)
        if refused is None:
            dtype, perturbation = noise_run(model)
            if shared and not FAULTS[shared].needs_speculator:  # the embedded pair carries the shared fault too
                perturbation = f"{perturbation}{SHARED_JOIN}{shared}"
            purpose = f"the noise source ({own})"
            beside = Beside(self._cached, model, seed, dtype, base, False, perturbation, None, self.noise_cache,
                            purpose)  # the noise run beside its reference: the embedded engine's runs are independent
            against: RunArtifacts | ReferenceFailed
            try:
                against = self._cached(model, seed, model.dtype, base, fault=shared, cache=self.noise_cache,
                                       purpose=purpose)
            except ReferenceFailed as exc:
                against = exc
            try:
                borrowed = beside.result()
                if isinstance(against, ReferenceFailed):
                    raise against
                return NoiseRuns(borrowed, against, f"noise: the embedded engine's reduction-order noise run "
                                                    f"against its {base.name} {model.dtype} run of the same "
                                                    f"checkpoint ({own})")
            except ReferenceFailed as exc:
                refused = str(exc)
        self.progress(f"  noise of {model.name} seed {seed}: {own}; the embedded engine cannot stand in ({refused})")
        return NoiseRuns(twin, None, f"noise: {own}, so the bounds are their floors; the embedded engine cannot "
                                     f"run the model to measure it ({refused})")

    def _reference_key(self, model: ModelSpec, seed: int, speculator: str, fault: str | None) -> tuple[str, int, str]:
        shared = self._reference_of(speculator, fault)[1]
        return model.name, seed, speculator + (f"+{shared}" if shared else "")

    def _server_needs(self, cells: Sequence[CellPlan]) -> set[str]:
        """What the servers of `cells`' runs are (server_pool.server_need): each cell's own, and its reference's
        and noise run's while they are not resolved yet."""
        needs = set()
        for cell in cells:
            if cell.skip_reason:
                continue
            model = seeded(cell.model, cell.seed, self.reseeds)
            needs.add(server_need(model, model.dtype, cell.topology))
            key = self._reference_key(cell.model, cell.seed, cell.topology.speculator, cell.fault)
            if key not in self._refs and key not in self._failed_refs:
                needs.add(server_need(model, model.dtype, self.reference_topology))
        return needs

    def _reference_of(self, speculator: str, fault: str | None) -> tuple[Topology, str | None]:
        """The reference topology of a cell with `speculator` and `fault`, and the fault the reference
        shares (Fault.shared: in code the reference runs too), if any."""
        base = self.reference_topology
        shared = fault if fault in FAULTS and FAULTS[fault].shared else None
        return Topology(tp=base.tp, dcp=base.dcp, speculator=speculator), shared

    def _noise_run(self, model: ModelSpec, seed: int, base: Topology,
                   shared: str | None = None) -> RunArtifacts | None:
        """The run the noise floor is measured against, by the reference engine's strategy: the
        reference in a higher precision, the same job run again (scheduling noise), or none. A fault the
        reference shares (Fault.shared) is in the noise run's code too: another reduction order of the
        same engine (perturbation+fault)."""
        strategy = self.ref_backend.noise_strategy()
        if strategy == NOISE_NONE:
            return None
        try:
            if strategy == NOISE_PRECISION_TWIN:
                return self._cached(model, seed, NOISE_DTYPE[model.dtype], base)
            if strategy == NOISE_REDUCTION_ORDER:
                dtype, perturbation = noise_run(model)
                if shared and perturbation and not FAULTS[shared].needs_speculator:  # the noise run has none
                    perturbation = f"{perturbation}{SHARED_JOIN}{shared}"
                return self._cached(model, seed, dtype, base, perturbation=perturbation)
            return self._cached(model, seed, model.dtype, base, repeat=True)
        except ReferenceFailed as exc:
            self.progress(f"  {exc}; tolerances fall back to their floors")
            return None

    def _decoder(self, model: ModelSpec) -> Callable[[Sequence[int]], str]:
        if model.name not in self._tokenizers:
            self._tokenizers[model.name] = load_tokenizer(model)
        return self._tokenizers[model.name].decode

    def command(self, cell: CellPlan, workload: str = "") -> str:
        """The command that re-runs exactly this cell: the request's suite, profile, pool, engines
        (RunRequest.reproduce) and the cell's topology, model (by path when given by path), seed and fault."""
        refs = dict(self.req.model_refs)
        shared = list(self.req.reproduce) or ["--suite", self.req.suite.name]
        engine_env = {**self.ref_backend.engine_env(), **self.backend.engine_env()}
        env = [f"{k}={shlex.quote(v)}" for k, v in engine_env.items()]
        parts = ["harness", "run", *shared, "--topo", cell.topology.name,
                 "--model", refs.get(cell.model.name, cell.model.name), "--seed", str(cell.seed)]
        if cell.fault:
            parts += ["--fault", cell.fault]
        if workload:
            parts += ["--workload", workload]
        if self.req.device != "cpu" and "--device" not in shared:
            parts += ["--device", self.req.device]
        return " ".join([*env, shlex.join(parts)])

    def _fault(self, cell: CellPlan) -> str | None:
        """The cell's fault: the harness's (--fault), else the engine-side one its environment sets
        ("HARNESS_VLLM_FAULT=kv-shard", template engine_faults): either makes the cell a positive control."""
        return cell.fault or self.backend.engine_fault()

    def _identity(self, cell: CellPlan) -> dict[str, Any]:
        """The CellResult fields every result of `cell` shares (who ran it, and how to run it again)."""
        return dict(suite=self.req.suite.name, model=cell.model.name, topology=cell.topology.name,
                    fault=self._fault(cell), condition=cell.fault in LOAD_CONDITIONS, seed=cell.seed,
                    command=self.command(cell), engine=self.backend.name,
                    reference_engine=self.ref_backend.name, engine_env=self.backend.engine_env(),
                    engine_build=self.backend.engine_build())

    def not_run(self, why: str) -> list[CellResult]:
        """Every planned cell (x workload) the run did not finish, each listed with `why` (an ERROR: no verdict)."""
        done = {cell_key(c) for c in self.finished}
        out = []
        for cell in self.planned():
            for w in (w for w in self.workload_names if self.wanted(cell, w)):
                result = CellResult(**{**self._identity(cell), "workload": w, "command": self.command(cell, w)},
                                    checks=(CheckResult(NOT_RUN_CHECK, Verdict.ERROR, f"not run: {why}"),),
                                    clean_exit=True)
                if cell_key(result) not in done:
                    out.append(result)
        return out

    def run_cell(self, cell: CellPlan) -> CellResult | list[CellResult]:
        """The cell's launch and its checks: one result per workload, or one SKIP / ERROR for all of them."""
        return self.launch_cell(cell)()

    def launch_cell(self, cell: CellPlan) -> Callable[[], CellResult | list[CellResult]]:
        """The cell's references and its launch, now; what it returns runs the checks (run_cell calls both). The
        matrix runs one cell's checks while the next cell's launch is under way (Runner._run)."""
        base = self._identity(cell)
        if cell.skip_reason:
            skipped = CellResult(**base, checks=(CheckResult("cell", Verdict.SKIP, cell.skip_reason),), clean_exit=True)
            return lambda: skipped
        if not self.cell_workloads(cell):  # the engine runs none of the workloads there: nothing is launched
            none_run = self.workload_skips(cell)
            return lambda: none_run
        try:
            ref, noise = self.references(cell.model, cell.seed, cell.topology.speculator, cell.fault)
        except ReferenceFailed as exc:
            if exc.refused:  # the engine refuses the model at the reference topology too: its own words, a SKIP
                refused = CellResult(**base, checks=(CheckResult("cell", Verdict.SKIP, f"reference: {exc.refused}"),),
                                     clean_exit=True)
                return lambda: refused
            failed = CellResult(**base, checks=(CheckResult("run", Verdict.ERROR, str(exc)),), clean_exit=False,
                                reference_dir=str(exc.run_dir) if exc.run_dir.exists() else "",
                                error_log=format_tails(exc.log_tails))
            return lambda: failed
        run_dir = self.req.out_dir / "runs" / cell.slug
        job = self.job(cell.model, cell.topology, cell.fault, cell.seed, run_dir)
        nodes = self._node_launch(cell)
        if nodes is None and self._reference_job(cell, job):
            self.progress(f"  {cell.topology.name}: the reference's own job on the same engine: its run is the "
                          f"reference run ({ref.path}), not launched again")
            return lambda: self._checked(cell, base, ref, ref, noise, ref.path, 0.0)
        result = (self.backend.run(job, self.req.timeout_s) if nodes is None
                  else self._on_nodes(job, nodes))
        return lambda: self._after_launch(cell, base, ref, noise, run_dir, result)

    def _after_launch(self, cell: CellPlan, base: dict[str, Any], ref: RunArtifacts, noise: NoiseRuns,
                      run_dir: Path, result: LaunchResult) -> CellResult | list[CellResult]:
        """The cell's results once its launch ended: a SKIP or ERROR for a refused or failed launch, else its
        checks."""
        if not result.ok and result.refused:  # the engine cannot run this topology: its own words, a SKIP
            return CellResult(**base, checks=(CheckResult("cell", Verdict.SKIP, result.refused),), clean_exit=True,
                              run_dir=str(run_dir), reference_dir=str(ref.path), wall_s=result.wall_s)
        if not result.ok:
            return CellResult(**base, checks=(CheckResult("run", Verdict.ERROR, result.error),), clean_exit=False,
                              run_dir=str(run_dir), reference_dir=str(ref.path), wall_s=result.wall_s,
                              error_log=format_tails(result.log_tails))
        par, problems = load_run(run_dir)
        if par is not None:
            problems = validate_artifacts(par)
        if problems:  # a malformed (third-party) run: one clear ERROR cell, never a crash in a check
            more = f" (+{len(problems) - 1} more; harness validate {run_dir})" if len(problems) > 1 else ""
            return CellResult(**base, checks=(CheckResult("run", Verdict.ERROR, f"parallel run breaks the "
                                                          f"artifacts contract: {problems[0]}{more}",
                                                          {"problems": problems}),),
                              clean_exit=True, run_dir=str(run_dir), reference_dir=str(ref.path), wall_s=result.wall_s)
        assert par is not None
        return self._checked(cell, base, ref, par, noise, run_dir, result.wall_s)

    def _checked(self, cell: CellPlan, base: dict[str, Any], ref: RunArtifacts, par: RunArtifacts,
                 noise: NoiseRuns, run_dir: Path, wall_s: float) -> list[CellResult]:
        """The cell's checks of `par` (read from `run_dir`) against the reference: one result per workload,
        each over that workload's cases (harness/records/workload_views.py)."""
        out = []
        workloads = self.cell_workloads(cell)
        views = workload_views(workloads, ref, par, noise.run, noise.against)
        evidence = _jump_evidence(views, workloads)
        for name, (r, p, n, against) in views.items():
            ctx = self.context(cell, r, p, NoiseRuns(n, against, noise.source), name, evidence)
            out.append(CellResult(**{**base, "workload": name, "command": self.command(cell, name)},
                                  checks=tuple(run_checks(ctx)), clean_exit=True, localization=ctx.localization,
                                  run_dir=str(run_dir), reference_dir=str(ref.path), wall_s=wall_s,
                                  details=ctx.details.to_dict()))
        return out + self.workload_skips(cell)

    def _reference_job(self, cell: CellPlan, job: Job) -> bool:
        """Whether `job` is the cell's reference job again (the reference topology, speculator and fault,
        on the same engine with the same options): the reference cache's key says, as it does for reruns.
        Such a cell (gsm8k's tp1) reads the reference run instead of paying for the same run twice."""
        if self.req.engine != self.req.ref_engine:
            return False
        topo, shared = self._reference_of(cell.topology.speculator, cell.fault)
        ref_job = self.job(cell.model, topo, shared, cell.seed, Path("."), cell.model.dtype)
        return self.cache.key(replace(job, dtype=job.dtype or cell.model.dtype)) == self.cache.key(ref_job)

    def context(self, cell: CellPlan, ref: RunArtifacts, par: RunArtifacts, noise: NoiseRuns,
                workload: str = SUITE_PROMPTS, evidence: JumpEvidence | None = None) -> CellContext:
        """Everything the checks of `cell` read (`evidence`: the engine's jumps under rounding over every greedy
        workload of the runs)."""
        suite = self.req.suite
        topo = cell.topology
        plan = plan_model(model_of(cell.model), topo)
        return CellContext(
            ref=ref, par=par, noise=noise.run, noise_ref=noise.against, noise_source=noise.source,
            jump_evidence=evidence, plan=plan.attention, hybrid_plan=plan.hybrid_plan,
            moe_plan=plan.moe if plan.hybrid_plan is None else None,
            indexer_plan=plan.indexer,
            layout_check=plan.model.attention.layout_check,
            settings=CheckSettings.from_suite(suite, cell.model.dtype),
            par_caps=run_capabilities(par, self.backend.capabilities()),
            ref_caps=run_capabilities(ref, self.ref_backend.capabilities()),
            info=CellInfo(suite=suite.name, model=cell.model.name, topology=topo.name, speculator=topo.speculator,
                          engine=self.backend.name, reference_engine=self.ref_backend.name,
                          report_dir=str(self.req.out_dir), baselines_dir=self.req.baselines_dir, workload=workload,
                          workloads_run=self.workload_names != (SUITE_PROMPTS,)),
            speculator_plan=plan.speculator, pd_plan=plan.pd, pd_state_plan=plan.pd_state_plan,
            decode=self._decoder(cell.model), gsm8k=self.req.gsm8k, enabled=suite.check_enabled)

    def planned(self) -> list[CellPlan]:
        """This machine's cells, in plan order: those of --gpus and --cells / --cells-from, then its shard
        (balanced by the cell list's estimates where it has them)."""
        req = self.req
        cells = self._selected()
        estimates = dict(req.estimates)
        costs = ([estimates.get(self.launch_id(c), 0.0) if not c.skip_reason else 0.0 for c in cells]
                 if estimates else None)
        return shard_cells(cells, req.shard, costs)

    def _selected(self) -> list[CellPlan]:
        """The plan's cells of --gpus and --cells / --cells-from (every share's), in plan order."""
        req = self.req
        cells = plan_cells(req, (self.backend, self.ref_backend))
        if req.gpus is not None:
            cells = [c for c in cells if c.topology.world_size == req.gpus]
        if req.cells is not None:
            cells = [c for c in cells if any(self.cell_id(c, w) in req.cells for w in self.workload_names)]
        return cells

    def cell_id(self, cell: CellPlan, workload: str) -> str:
        """The cell's id (harness/records/cells.py) with the fault its results carry (the harness's or the engine's
        own, _fault), so ids from a plan and from a results.json agree."""
        return cell_id(self.req.suite.name, cell.model.name, cell.topology.name, self._fault(cell), cell.seed,
                       workload)

    def launch_id(self, cell: CellPlan) -> str:
        return launch_id(self.req.suite.name, cell.model.name, cell.topology.name, self._fault(cell), cell.seed)

    def wanted(self, cell: CellPlan, workload: str) -> bool:
        """Whether the cell's `workload` is one the run was asked for (every one without --cells)."""
        return self.req.cells is None or self.cell_id(cell, workload) in self.req.cells

    def reference_key(self, cell: CellPlan) -> str:
        """The cache key of the cell's reference run (what every shard of a nightly reads once it is cached)."""
        topo, shared = self._reference_of(cell.topology.speculator, cell.fault)
        return self.cache.key(self.job(cell.model, topo, shared, cell.seed, Path("."), cell.model.dtype))

    def prepare_references(self) -> tuple[int, int]:
        """The reference and noise runs of the selected cells into the cache, the first phase of a nightly whose
        shards then read them: with a shard, its share of the distinct references (each once over the shares);
        (references ready, references failed)."""
        shard = self.req.shard
        unsharded = [c for c in self._selected() if not c.skip_reason]
        wanted: dict[tuple[str, int, str], CellPlan] = {}
        for cell in unsharded:
            wanted.setdefault(self._reference_key(cell.model, cell.seed, cell.topology.speculator, cell.fault), cell)
        keys = list(wanted)
        mine = select(keys, [1.0] * len(keys), shard) if shard is not None else keys
        done = failed = 0
        for key in mine:
            cell = wanted[key]
            try:
                self.references(cell.model, cell.seed, cell.topology.speculator, cell.fault)
                done += 1
            except ReferenceFailed as exc:
                if exc.refused:  # the engine refuses the model there: its cells are SKIPs, not a failed phase
                    self.progress(f"  reference of {cell.slug} refused by the engine: {exc.refused}")
                    continue
                self.progress(f"  {exc}")
                failed += 1
        return done, failed

    def _node_launch(self, cell: CellPlan) -> NodeLaunch | None:
        """A cell spanning the nodes rendezvouses on the port of its index in the plan."""
        nodes = self.req.nodes
        if nodes is None or not nodes.spans(cell.topology.world_size):
            return None
        return nodes.launch([c.slug for c in self.planned()].index(cell.slug))

    def _on_nodes(self, job: Job, nodes: NodeLaunch) -> LaunchResult:
        """The parallel run of a cell that spans the nodes: only the embedded engines launch over nodes."""
        backend = self.backend.inner if isinstance(self.backend, LabelledBackend) else self.backend
        if not isinstance(backend, EmbeddedBackend):
            raise ConfigError(f"engine {self.backend.name!r} cannot run over several nodes from the harness")
        return backend.run_on_nodes(job, self.req.timeout_s, nodes)

    def follow(self) -> int:
        """Node R > 0: lend this node's ranks to every cell that spans the nodes, in plan order.
        0 when every launch exited cleanly, else ExitCode.ERROR (node 0's report has the verdicts)."""
        req, progress = self.req, self.progress
        nodes = req.nodes
        assert nodes is not None and nodes.node_rank > 0
        failed = 0
        for index, cell in enumerate(self.planned()):
            if cell.skip_reason or not nodes.spans(cell.topology.world_size):
                progress(f"[{index + 1}] {cell.slug}: runs on node 0")
                continue
            job = self.job(cell.model, cell.topology, cell.fault, cell.seed, req.out_dir / "runs" / cell.slug)
            progress(f"[{index + 1}] {cell.slug}: node {nodes.node_rank} ranks joining "
                     f"{nodes.host}:{nodes.port + index}")
            result = self._on_nodes(job, nodes.launch(index))
            ok = result.returncode == 0
            failed += not ok
            progress(f"[{index + 1}] {cell.slug}: {'done' if ok else 'FAILED: ' + result.error} "
                     f"({result.wall_s:.1f} s)")
        return ExitCode.OK if not failed else ExitCode.ERROR

    def run(self) -> list[CellResult]:
        """Every cell of the plan, run in serving order (serving_order: the runs of one engine configuration
        adjacent, so each HTTP engine server serves them all and is stopped once no later cell needs it); the
        results in plan order."""
        with self.servers.session():
            return self._run()

    def _run(self) -> list[CellResult]:
        cells = self.planned()
        order = serving_order(cells, self.reseeds)
        results = self.finished = []
        at: list[int] = []  # each result's cell's index in the plan
        ahead = self._launch_ahead()
        if ahead and not any(var in os.environ for var in (*THREAD_VARS, THREADS_ENV)):
            # the checks run while the next launch's ranks hold the cores, where a second intra-op thread of their
            # small tensor ops only waits for a core (the logits metrics of one prompt: 0.96 ms on 2 threads, 0.37 ms
            # on one, on the idle 2-core box; several times that beside running ranks)
            torch.set_num_threads(1)
        launched: Beside | None = None  # the next cell's launch, under way while this cell's checks run
        try:
            for i, index in enumerate(order, 1):
                cell = cells[index]
                finish = launched.result() if launched is not None else self._launch(order, cells, i)
                launched = Beside(self._launch, order, cells, i + 1) if ahead and i < len(order) else None
                try:
                    got = finish()
                except Exception as exc:  # one broken cell (a harness bug included) never loses the others' results
                    got = self._broken(cell, exc)
                for result in (got if isinstance(got, list) else self.per_workload(cell, got)):
                    if not self.wanted(cell, result.workload):
                        continue
                    self._record(i, len(cells), cell, result, results)
                    at.append(index)
        except BaseException:  # interrupted, or a full disk: the launch under way must not outlive the run
            if launched is not None:
                stop_all_launches()
            raise
        return [r for _, r in sorted(zip(at, results), key=lambda pair: pair[0])]

    def _launch_ahead(self) -> bool:
        """Whether the next cell launches while a cell's checks run: where both engines' runs are independent
        (each launch its own processes; an HTTP engine's server pool is planned one cell at a time) on one node.
        The launches and the checks are the same as one after the other; only their overlap differs."""
        return self.backend.independent_runs() and self.ref_backend.independent_runs() and self.req.nodes is None

    def _launch(self, order: Sequence[int], cells: Sequence[CellPlan],
                i: int) -> Callable[[], CellResult | list[CellResult]]:
        """The `i`-th cell of `order` launched (launch_cell): what runs its checks, or gives its ERROR."""
        cell = cells[order[i - 1]]
        self.servers.retain(self._server_needs([cells[j] for j in order[i - 1:]]))
        self.progress(f"[{i}/{len(cells)}] {cell.slug} ...")
        try:
            return self.launch_cell(cell)
        except Exception as exc:  # one broken cell (a harness bug included) never loses the others' results
            broken = self._broken(cell, exc)
            return lambda: broken

    def _broken(self, cell: CellPlan, exc: Exception) -> CellResult:
        """The ERROR result of a cell whose launch or checks raised `exc`."""
        if not isinstance(exc, HarnessError):
            exc = RunError(f"internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return CellResult(**self._identity(cell), checks=(CheckResult("run", Verdict.ERROR, str(exc)),),
                          clean_exit=False)

    def _record(self, i: int, n: int, cell: CellPlan, result: CellResult, results: list[CellResult]) -> None:
        """Report one cell's result (a line of progress) and keep it; a full disk stops the run."""
        reason = next((c.reason for c in result.checks if c.verdict is result.status), "")
        took = "the reference run" if result.run_dir and result.run_dir == result.reference_dir else \
            f"{result.wall_s:.1f} s"
        label = cell.slug + (f" {result.workload}" if len(self.workload_names) > 1 else "")
        self.progress(f"[{i}/{n}] {label}: {result.status.value} ({took})"
                      + (f" - {reason}" if result.status is not Verdict.PASS else ""))
        full = self._disk_full(reason) if result.status is Verdict.ERROR else None
        if full is not None:  # every later cell would fail alike: stop, keep the cells done
            folder, free = full
            shutil.rmtree(self.req.out_dir / "runs" / cell.slug, ignore_errors=True)  # incomplete; frees room
            results.append(replace(result, run_dir="", checks=(CheckResult(
                "run", Verdict.ERROR, f"no space left on device in {folder} ({free} bytes free): {reason}"),)))
            raise DiskFull(folder, free, cell.slug)
        results.append(result)

    def _disk_full(self, reason: str) -> tuple[Path, int] | None:
        """(folder, free bytes) when the out or cache folder's disk is full: a cell error that says so, or
        less room left than one run folder needs."""
        free, folder = min((free_bytes(f), f) for f in (self.req.out_dir, self.req.cache_dir))
        if free < RUN_DIR_MIN_BYTES or os.strerror(errno.ENOSPC) in reason:
            return folder, free
        return None

    def machine_backends(self) -> dict[str, dict[str, Any]]:
        """Per model, the attention backend the parallel engine runs it with on this machine (where that depends on
        the machine: Backend.machine_backend)."""
        out = {}
        for model in self.req.models:
            record = self.backend.machine_backend(model)
            if record is not None:
                out[model.name] = record
        return out

    def provenance(self, argv: list[str]) -> dict[str, Any]:
        return {**collect_provenance(shlex.join(["harness", *argv]), self.req.device,
                                     sorted({m.dtype for m in self.req.models}), list(self.req.seeds)),
                "suite": self.req.suite.name, "suite_version": self.req.suite.version,
                "reference": self.reference_topology.name, "engine": self.backend.name,
                "engine_version": self.backend.version(), "reference_engine": self.ref_backend.name,
                **({"engine_build": self.backend.engine_build()} if self.backend.engine_build() else {}),
                "backends": {"parallel": backend_record(self.backend), "reference": backend_record(self.ref_backend)},
                **({"attention_backends": backends} if (backends := self.machine_backends()) else {}),
                **({"shard": str(self.req.shard)} if self.req.shard else {}),
                **({"servers": self.servers.records()} if self.servers.served else {}),
                **({"nnodes": self.req.nodes.nnodes} if self.req.nodes else {})}


def serving_order(cells: Sequence[CellPlan], reseeds: bool = True) -> list[int]:
    """The plan's cell indexes in the order they run: by model, then by weights (with `reseeds` a seed that
    reseeds synthetic weights is another model, `seeded`), by the topology's tp and dcp (a -draft cell beside the
    plain one), then by seed; otherwise in plan order. The runs needing one engine configuration are then
    adjacent."""
    first: dict[Any, int] = {}

    def rank(value: Any) -> int:
        return first.setdefault(value, len(first))

    keys = [(rank(c.model.name), c.seed if reseeds and c.model.source == "synthetic" else 0,
             rank((c.topology.tp, c.topology.dcp)), c.seed, i) for i, c in enumerate(cells)]
    return [k[-1] for k in sorted(keys)]


def _embedded(backend: Backend) -> bool:
    """Whether `backend` is the embedded engine (or a build-labelled one): its own noise run is the one to use."""
    return isinstance(backend.inner if isinstance(backend, LabelledBackend) else backend, EmbeddedBackend)


def format_tails(tails: dict[str, str]) -> str:
    return "\n".join(f"--- {name} ---\n{text}" for name, text in tails.items() if text)

