"""The matrix flow, written once: plan cells -> reference runs (cached) -> one launch per cell ->
compare -> CellResults. Stages talk through run directories (harness/artifacts.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from harness import __version__
from harness.artifacts import RunArtifacts, read_run
from harness.compare.cell import compare_cell
from harness.compare.settings import CheckSettings
from harness.compare.speculative import acceptance_from_runs, lossless_from_run, speculator_details
from harness.engine.faults import FAULTS, fault_flags
from harness.engine.checkpoint import checkpoint_path
from harness.engine.tokenizer import Tokenizer, load_tokenizer
from harness.engine.worker import ENGINE_VERSION, Job
from harness.baseline import BASELINES_DIR
from harness.gsm8k.cell import gsm8k_checks
from harness.gsm8k.settings import GSM8KSettings
from harness.errors import ConfigError, HarnessError, RunError
from harness.jsonio import read_json
from harness.launch import launch
from harness.limits import COLLECTIVE_TIMEOUT_S, LAUNCH_TIMEOUT_S
from harness.layout import plan_layout, plan_speculator
from harness.paths import PROJECT_ROOT
from harness.report.provenance import collect_provenance, git_commit
from harness.multinode import NodeLaunch, Nodes
from harness.shard import Shard, shard_cells
from harness.specs.model import ModelSpec
from harness.specs.suite import Suite
from harness.specs.topology import Topology, parse_topology_name
from harness.verdict import CellResult, CheckResult, Verdict

NOISE_DTYPE = {"float32": "float64", "bfloat16": "float32", "float16": "float32"}


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
    shard: Shard | None = None  # run only this share of the cells (harness/shard.py)
    nodes: Nodes | None = None  # this machine's place in a multi-node run (harness/multinode.py)


@dataclass(frozen=True)
class CellPlan:
    model: ModelSpec
    topology: Topology
    fault: str | None
    seed: int
    skip_reason: str | None

    @property
    def slug(self) -> str:
        return f"{self.model.name}/{self.topology.name}{'-' + self.fault if self.fault else ''}/seed{self.seed}"


def default_cache_dir() -> Path:
    return Path(os.environ.get("HARNESS_CACHE_DIR", Path.home() / ".cache" / "llm-parallel-harness"))


def _engine_source_hash() -> str:
    """Reference runs are cached by content; the code that produces them is part of that content
    (everything in harness/ but the report and CLI layers)."""
    h = hashlib.sha256(ENGINE_VERSION.encode())
    package = PROJECT_ROOT / "harness"
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] not in ("report", "cli"):
            h.update(str(path.relative_to(package)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _weights_key(model: ModelSpec) -> dict[str, Any]:
    """Identifies the weights without loading them: the spec, plus size and mtime of a weight file."""
    key: dict[str, Any] = {"spec": model.to_dict()}
    if model.source != "synthetic":
        path = checkpoint_path(model)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        key["files"] = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]
    return key


def seeded(model: ModelSpec, seed: int) -> ModelSpec:
    """A run seed also reseeds synthetic weights, so seeds cover different models, not only prompts."""
    return replace(model, seed=model.seed + seed) if model.source == "synthetic" else model


def skip_reason(model: ModelSpec, topo: Topology, fault: str | None) -> str | None:
    """Why a cell cannot run (model does not split, fault does not apply), or None."""
    try:
        plan_layout(model.attention_shape, topo.tp, topo.dcp)
    except ConfigError as exc:
        return f"{model.name} does not split at {topo.name}: {exc}"
    if topo.speculator != "none":
        if model.speculator_layers > model.layers:
            return f"{model.name}: speculator_layers={model.speculator_layers} exceeds layers={model.layers}"
        try:
            plan_speculator(model.speculator_shape, topo.tp)
        except ConfigError as exc:
            return f"{model.name}'s speculator does not split at {topo.name}: {exc}"
    if fault:
        try:
            fault_flags(fault, topo)
        except ConfigError as exc:
            return str(exc)
    return None


def plan_cells(req: RunRequest) -> list[CellPlan]:
    if req.fault and req.fault not in FAULTS:
        fault_flags(req.fault, Topology(tp=1))  # raises the did-you-mean error
    return [CellPlan(m, t, req.fault, seed, skip_reason(m, t, req.fault))
            for m in req.models for seed in req.seeds for t in req.topologies]


class Runner:
    """Runs a matrix; the reference (and its noise-floor twin) is launched once per (model, seed)."""

    def __init__(self, req: RunRequest, progress: Callable[[str], None] = print) -> None:
        self.req = req
        self.progress = progress
        self._refs: dict[tuple[str, int, str], tuple[RunArtifacts, RunArtifacts | None]] = {}
        self.reference_topology = parse_topology_name(req.suite.reference).without_speculator()
        self._commit = git_commit()
        self._failed_refs: dict[tuple[str, int, str], ReferenceFailed] = {}
        self._engine_hash = _engine_source_hash()
        self._tokenizers: dict[str, Tokenizer] = {}

    def job(self, model: ModelSpec, topo: Topology, fault: str | None, seed: int, out_dir: Path,
            dtype: str | None = None) -> Job:
        s, req = self.req.suite, self.req
        in_model_dtype = dtype in (None, model.dtype)  # the noise-floor twin skips GSM8K
        gsm8k = ({"settings": req.gsm8k.to_dict(), "data_path": req.gsm8k_data}
                 if req.gsm8k is not None and in_model_dtype else None)
        return Job(model=seeded(model, seed).to_dict(), topology=topo.to_dict(), prompts=list(s.prompts),
                   out_dir=str(out_dir), fault=fault, dtype=dtype, seed=seed, max_new_tokens=s.max_new_tokens,
                   decode_prefix_tokens=s.decode_prefix_tokens, pool=dict(req.pool), device=req.device,
                   collective_timeout_s=req.collective_timeout_s, git_commit=self._commit, gsm8k=gsm8k,
                   speculative=dict(s.speculative) if topo.speculator != "none" else {})

    def _cached(self, model: ModelSpec, seed: int, dtype: str, topo: Topology) -> RunArtifacts:
        """A reference-topology run of `model` in `dtype`, from the content-keyed cache or launched now."""
        job = self.job(model, topo, None, seed, Path("."), dtype)
        content = {k: v for k, v in job.__dict__.items() if k not in ("out_dir", "git_commit", "collective_timeout_s")}
        key = hashlib.sha256(json.dumps({"job": content, "weights": _weights_key(model),
                                         "engine": self._engine_hash}, sort_keys=True, default=str).encode())
        run_dir = self.req.cache_dir / "runs" / f"{model.name}-{topo.name}-{dtype}-{key.hexdigest()[:16]}"
        label = f"reference {model.name} {topo.name} {dtype} seed {seed}"
        if (run_dir / "manifest.json").exists():
            try:
                cached = read_run(run_dir)
            except RunError as exc:  # a damaged cache entry is launched again, never trusted
                self.progress(f"  {label}: cache entry unreadable ({exc}); running again")
                cached = None
            if cached is not None and cached.ok:
                self.progress(f"  {label}: cached ({run_dir})")
                return cached
            shutil.rmtree(run_dir, ignore_errors=True)
        self.progress(f"  {label}: running")
        # launched into a private folder and renamed into place, so two runs sharing a cache never
        # write into one folder; a folder that is there by then is another run's identical result
        staging = run_dir.with_name(f"{run_dir.name}.{os.getpid()}.partial")
        result = launch(replace(job, out_dir=str(staging)), self.req.timeout_s)
        if not result.ok:
            raise ReferenceFailed(f"reference run of {model.name} ({dtype}) failed: {result.error}", staging)
        try:
            staging.rename(run_dir)  # only successful runs ever sit at run_dir
        except OSError:  # another run renamed its identical result into place first
            shutil.rmtree(staging, ignore_errors=True)
        return read_run(run_dir)

    def references(self, model: ModelSpec, seed: int, speculator: str = "none") -> tuple[RunArtifacts, RunArtifacts | None]:
        """The reference (the suite's reference topology with the cell's speculator) and its noise-floor
        twin (same topology, higher precision, no speculator). A failed reference is launched once:
        later cells get the same ReferenceFailed. A failed twin leaves the tolerance floors in charge."""
        key = (model.name, seed, speculator)
        if key in self._failed_refs:
            raise self._failed_refs[key]
        if key not in self._refs:
            base = self.reference_topology
            try:
                ref = self._cached(model, seed, model.dtype, Topology(tp=base.tp, dcp=base.dcp, speculator=speculator))
            except ReferenceFailed as exc:
                self._failed_refs[key] = exc
                raise
            try:
                noise: RunArtifacts | None = self._cached(model, seed, NOISE_DTYPE[model.dtype], base)
            except ReferenceFailed as exc:
                self.progress(f"  {exc}; tolerances fall back to their floors")
                noise = None
            self._refs[key] = (ref, noise)
        return self._refs[key]

    def _decoder(self, model: ModelSpec) -> Callable[[Sequence[int]], str]:
        if model.name not in self._tokenizers:
            self._tokenizers[model.name] = load_tokenizer(model)
        return self._tokenizers[model.name].decode

    def command(self, cell: CellPlan) -> str:
        parts = ["harness", "run", "--suite", self.req.suite.name, "--topo", cell.topology.name,
                 "--model", cell.model.name, "--seed", str(cell.seed)]
        if cell.fault:
            parts += ["--fault", cell.fault]
        if self.req.device != "cpu":
            parts += ["--device", self.req.device]
        return " ".join(parts)

    def run_cell(self, cell: CellPlan) -> CellResult:
        base = dict(suite=self.req.suite.name, model=cell.model.name, topology=cell.topology.name,
                    fault=cell.fault, seed=cell.seed, command=self.command(cell))
        if cell.skip_reason:
            return CellResult(**base, checks=(CheckResult("cell", Verdict.SKIP, cell.skip_reason),), clean_exit=True)
        try:
            ref, noise = self.references(cell.model, cell.seed, cell.topology.speculator)
        except ReferenceFailed as exc:
            return CellResult(**base, checks=(CheckResult("run", Verdict.ERROR, str(exc)),), clean_exit=False,
                              reference_dir=str(exc.run_dir), error_log=_tails_text(exc.run_dir))
        run_dir = self.req.out_dir / "runs" / cell.slug
        result = launch(self.job(cell.model, cell.topology, cell.fault, cell.seed, run_dir), self.req.timeout_s,
                        nodes=self._node_launch(cell))
        if not result.ok:
            return CellResult(**base, checks=(CheckResult("run", Verdict.ERROR, result.error),), clean_exit=False,
                              run_dir=str(run_dir), reference_dir=str(ref.path), wall_s=result.wall_s,
                              error_log=format_tails(result.log_tails))
        par = read_run(run_dir)
        plan = plan_layout(cell.model.attention_shape, cell.topology.tp, cell.topology.dcp)
        settings = CheckSettings.from_suite(self.req.suite, cell.model.dtype)
        spec_plan = (plan_speculator(cell.model.speculator_shape, cell.topology.tp)
                     if cell.topology.speculator != "none" else None)
        checks, loc, details = compare_cell(ref, par, noise, plan, settings, speculator_plan=spec_plan,
                                            decode=self._decoder(cell.model))
        if spec_plan is not None:
            acceptance = acceptance_from_runs(ref, par, settings.acceptance)
            checks += [lossless_from_run(par, settings.lossless), acceptance]
            details["speculator"] = speculator_details(acceptance, cell.topology.speculator)
        if self.req.gsm8k is not None:
            gsm8k_checks_, details["gsm8k"] = gsm8k_checks(ref.path, run_dir, self.req.gsm8k, self.req.suite.name,
                                                          cell.model.name, cell.topology.name, str(self.req.out_dir),
                                                          self.req.baselines_dir)
            checks += gsm8k_checks_
        return CellResult(**base, checks=tuple(checks), clean_exit=True, localization=loc, run_dir=str(run_dir),
                          reference_dir=str(ref.path), wall_s=result.wall_s, details=details)

    def _node_launch(self, cell: CellPlan) -> NodeLaunch | None:
        """A cell spanning the nodes rendezvouses on the port of its index in the plan."""
        nodes = self.req.nodes
        if nodes is None or not nodes.spans(cell.topology.world_size):
            return None
        slugs = [c.slug for c in shard_cells(plan_cells(self.req), self.req.shard)]
        return nodes.launch(slugs.index(cell.slug))

    def run(self) -> list[CellResult]:
        cells = shard_cells(plan_cells(self.req), self.req.shard)
        results = []
        for i, cell in enumerate(cells, 1):
            self.progress(f"[{i}/{len(cells)}] {cell.slug} ...")
            try:
                result = self.run_cell(cell)
            except HarnessError as exc:  # one broken cell never loses the others' results
                result = CellResult(suite=self.req.suite.name, model=cell.model.name, topology=cell.topology.name,
                                    fault=cell.fault, seed=cell.seed, command=self.command(cell),
                                    checks=(CheckResult("run", Verdict.ERROR, str(exc)),), clean_exit=False)
            reason = next((c.reason for c in result.checks if c.verdict is result.status), "")
            self.progress(f"[{i}/{len(cells)}] {cell.slug}: {result.status.value} ({result.wall_s:.1f} s)"
                          + (f" - {reason}" if result.status is not Verdict.PASS else ""))
            results.append(result)
        return results

    def provenance(self, argv: list[str]) -> dict[str, Any]:
        return {**collect_provenance(" ".join(["harness", *argv]), self.req.device,
                                     sorted({m.dtype for m in self.req.models}), list(self.req.seeds)),
                "suite": self.req.suite.name, "suite_version": self.req.suite.version,
                "reference": self.reference_topology.name, "engine": "reference", "engine_version": ENGINE_VERSION,
                **({"shard": str(self.req.shard)} if self.req.shard else {}),
                **({"nnodes": self.req.nodes.nnodes} if self.req.nodes else {})}


class ReferenceFailed(HarnessError):
    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir


def format_tails(tails: dict[str, str]) -> str:
    return "\n".join(f"--- {name} ---\n{text}" for name, text in tails.items() if text)


def _tails_text(run_dir: Path) -> str:
    try:
        return format_tails(read_json(run_dir / "manifest.json").get("log_tails") or {})
    except RunError:
        return ""
