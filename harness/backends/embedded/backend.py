"""The embedded engine as a backend: harness.backends.embedded.worker under torchrun (launch.launch).

`embedded` produces every artifact of the contract. `embedded:batch-invariant` is the same engine in its
batch-invariant mode: every request's forward runs alone (one forward per request per engine step, whatever else is
scheduled), so its logprobs are bitwise the same in any batch and on every run; it declares that
(Capabilities.batch_invariant) and the route checks hold it to exact equality (docs/checks.md#exactness).

`embedded-topk` is the same engine in its top-k-only mode: it withholds full logits, hidden states and attention
outputs and writes top-K logprobs of both teacher-forced paths instead, as an HTTP engine would; it proves that the
logits checks work from top-k logprobs (positive controls in tests/test_backends_topk.py).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.backends.base import stamp_manifest
from harness.backends.identity import code_hash
from harness.core.errors import ConfigError
from harness.core.jsonio import write_json
from harness.engine import ENGINE_VERSION
from harness.formats.locate import weights_key
from harness.launcher.launch import launch
from harness.launcher.nodes import NodeLaunch
from harness.records import contract as c
from harness.records.contract import Backend, Capabilities, Job, LaunchResult
from harness.records.pd_files import STORE_DAMAGE, damage_store
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

WORKER_MODULE = "harness.backends.embedded.worker"  # each rank runs WORKER_MODULE.main(job file, flags)
ENGINE_ENTRIES: tuple[str, ...] = (WORKER_MODULE, "harness.launcher.launch")
PREFILL_DIR = "prefill"  # a disaggregated run's prefill world's folder inside the run directory
TOPK_ONLY_K = 20  # logprobs per position in the top-k-only mode (vLLM's default max_logprobs is 20)
BATCH_INVARIANT = "batch-invariant"  # the embedded engine's option: one forward per request (worker --batch-invariant)

TOPK_ONLY: frozenset[str] = (c.FULL_ARTIFACTS
                              - {c.FULL_LOGITS, c.HIDDEN_STATES, c.ATTENTION_OUTPUTS, c.COLLECTIVE_ERRORS}) \
    | {c.TOPK_LOGPROBS}


class EmbeddedBackend(Backend):
    """The pure-PyTorch reference engine, launched per job (the default engine)."""

    name = "embedded"

    def __init__(self, option: str | None = None) -> None:
        if option and option != BATCH_INVARIANT:
            raise ConfigError(f"engine {self.name!r} takes no option but {BATCH_INVARIANT!r} "
                              f"({self.name}:{BATCH_INVARIANT}), got {option!r}")
        self.batch_invariant = option == BATCH_INVARIANT
        self._code: str | None = None

    def version(self) -> str:
        return ENGINE_VERSION

    def capabilities(self) -> Capabilities:
        return Capabilities(provides=c.FULL_ARTIFACTS, batch_invariant=self.batch_invariant)

    def worker_args(self) -> list[str]:
        return ["--batch-invariant"] if self.batch_invariant else []

    def identity(self, job: Job) -> dict[str, Any]:
        if self._code is None:
            self._code = "".join(code_hash(entry) for entry in ENGINE_ENTRIES)
        return {"engine": self.name, "version": self.version(), "worker_args": self.worker_args(),
                "weights": weights_key(job.model), "code": self._code}

    disaggregated = True  # runs PREFILL>DECODE topologies (two worlds, the KV store between them)

    def skip_reason(self, model: ModelSpec, topology: Topology) -> str | None:
        if topology.prefill is not None and not model_of(model).prefix_cacheable \
                and plan_model(model_of(model), topology).pd_state_plan is None:
            return ("the embedded KV connector moves paged attention KV and linear-attention state; this model keeps "
                    "other per-sequence state outside the KV blocks, which no transfer plan covers")
        return None  # every layout the planner accepts (the runner checks that first)

    def noise_strategy(self) -> str:
        return c.NOISE_REDUCTION_ORDER  # same dtype, another reduction order (runner.noise_run)

    def independent_runs(self) -> bool:
        return True  # each launch its own processes

    def run(self, job: Job, timeout_s: float) -> LaunchResult:
        if job.topology.prefill is not None:
            return self._run_pd(job, timeout_s)
        result = launch(job, timeout_s, WORKER_MODULE, worker_args=self.worker_args())
        stamp_manifest(Path(job.out_dir), self)
        return result

    def _run_pd(self, job: Job, timeout_s: float) -> LaunchResult:
        """A disaggregated topology: the prefill world (job.topology.prefill's ranks) fills the KV store under
        the run directory, then the decode world (the cell's run) loads from it
        (harness/backends/embedded/worker_pd.py)."""
        out = Path(job.out_dir)
        store = out / c.PD_STORE_DIR
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True)
        pre = replace(job, out_dir=str(out / PREFILL_DIR))
        assert job.topology.prefill is not None
        first = launch(pre, timeout_s, WORKER_MODULE, world_size=job.topology.prefill.world_size,
                       worker_args=[*self.worker_args(), "--pd-role", "prefill", "--pd-store", str(store)])
        if not first.ok:
            error = f"prefill world ({job.topology.prefill.name}) failed: {first.error}"
            write_json(out / c.MANIFEST_FILE, {"schema_version": 1, "status": "error", "error": error,
                                                "topology": job.topology.to_dict(), "fault": job.fault,
                                                "log_tails": first.log_tails})
            return replace(first, error=error)
        if job.fault in STORE_DAMAGE:  # a load condition: the stored KV damaged between the two worlds
            damage_store(store, job.fault)
        result = launch(job, timeout_s, WORKER_MODULE,
                        worker_args=[*self.worker_args(), "--pd-role", "decode", "--pd-store", str(store)])
        stamp_manifest(out, self)
        return result

    def run_on_nodes(self, job: Job, timeout_s: float, nodes: NodeLaunch) -> LaunchResult:
        """The run with this node's share of the ranks (torchrun rendezvous); node 0 stamps the manifest."""
        result = launch(job, timeout_s, WORKER_MODULE, worker_args=self.worker_args(), nodes=nodes)
        if nodes.node_rank == 0:
            stamp_manifest(Path(job.out_dir), self)
        return result


class TopkOnlyBackend(EmbeddedBackend):
    """The embedded engine withholding full logits, hidden states and attention outputs
    (`embedded-topk` or `embedded-topk:K` for K logprobs per position)."""

    name = "embedded-topk"

    def __init__(self, option: str | None = None) -> None:
        super().__init__(None)
        self.k = TOPK_ONLY_K
        if option:
            if not option.isdigit() or int(option) < 2:
                raise ConfigError(f"engine {self.name}:K needs an integer K >= 2, got {option!r}")
            self.k = int(option)

    def capabilities(self) -> Capabilities:
        return Capabilities(provides=TOPK_ONLY, top_k=self.k)

    def worker_args(self) -> list[str]:
        return ["--topk", str(self.k)]
