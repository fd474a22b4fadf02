"""The run contract between the harness and an engine backend: the job a backend is given, what it
reports back, the names of the artifacts it writes, and the capabilities it declares.

A backend turns a `Job` into a run directory (harness/records/artifacts.py documents its layout) and returns
a `LaunchResult`. Every stage after that reads only the run directory, so any engine that can write
one (the embedded engine under torchrun, an HTTP server, a stored run replayed) gets the same
verdicts. A backend declares which artifacts it can produce (`Capabilities`); a check whose needs
are not met is a SKIP naming the missing capability, never an ERROR.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from harness.core.errors import ConfigError
from harness.core.jsonio import read_json
from harness.core.limits import COLLECTIVE_TIMEOUT_S
from harness.records.rankreport import RANK_REPORT_SCHEMA
from harness.specs.loader import check_keys
from harness.specs.model import ModelSpec, model_from_dict
from harness.specs.pool import PoolSettings
from harness.specs.send_schedule import SendSchedule
from harness.specs.speculative import SpeculativeSettings
from harness.specs.topology import Topology
from harness.specs.workload import Workload

# --- tensor kinds in tensors.safetensors (one entry per case i: f"{kind}.{i}") ------------------
PREFILL_LOGITS = "prefill_logits"          # [T, V] float32, teacher-forced prefill
DECODE_LOGITS = "decode_logits"            # [T-D, V] float32, one-token decode steps from D
PREFILL_TOPK_IDS = "prefill_topk_ids"      # [T, k] int64, top-k of the prefill path (top-k-only engines)
PREFILL_TOPK_LOGPROBS = "prefill_topk_logprobs"  # [T, k] float32, their log-probabilities
DECODE_TOPK_IDS = "decode_topk_ids"        # [T-D, k] int64, top-k of the decode path
DECODE_TOPK_LOGPROBS = "decode_topk_logprobs"    # [T-D, k] float32
HIDDEN = "hidden"                          # [L+1, P, H] residual stream at probe positions
ATTN = "attn"                              # [L, P, heads, head_dim] per-head attention output
COLLECTIVES = "collectives"                # [tp, L, P, sites] float32, optional: each rank's error of each
#   collective's output vs an exact recompute from its inputs, in unit roundoffs of the model dtype: all-reduce
#   sites elementwise relative to the sum of |partials| (<= tp - 1 when correct), DCP sites normwise
GEN_TOKENS = "gen_tokens"                  # [N] int64 greedy generation
GEN_TOPK_IDS = "gen_topk_ids"              # [N, k] int64
GEN_TOPK_LOGPROBS = "gen_topk_logprobs"    # [N, k] float32
SPEC_TOKENS = "spec_tokens"                # [N] int64 greedy generation with the speculator
SPEC_ACCEPTED = "spec_accepted"            # [S] int64 accepted draft tokens per verify step
SPEC_DRAFTS = "spec_drafts"                # [S, k] int64, optional: the proposals of each verify step
# an HTTP speculative server's answer per generated step, and its re-prefill of prompt + those tokens
SPEC_TOPK_IDS = "spec_topk_ids"            # [N, k] int64
SPEC_TOPK_LOGPROBS = "spec_topk_logprobs"  # [N, k] float32
SPEC_REPREFILL_TOPK_IDS = "spec_reprefill_topk_ids"            # [N, k] int64
SPEC_REPREFILL_TOPK_LOGPROBS = "spec_reprefill_topk_logprobs"  # [N, k] float32
# workload runs (Job.workloads): the same prompts generated once more in one plain batch (no prefix cache,
# no chunks, no preemption: the schedule twin), and each generation re-prefilled (prompt + new tokens)
TWIN_TOKENS = "twin_tokens"                # [N] int64 greedy generation of the plain batch
TWIN_TOPK_IDS = "twin_topk_ids"            # [N, k] int64
TWIN_TOPK_LOGPROBS = "twin_topk_logprobs"  # [N, k] float32
REPREFILL_TOPK_IDS = "reprefill_topk_ids"  # [N, k] int64: top-k of the prefill path at each generated step
REPREFILL_TOPK_LOGPROBS = "reprefill_topk_logprobs"  # [N, k] float32
# sampling workloads (Workload.sampling): n draws of the engine's sampler at each teacher-forced position that
# picks a new token (prompt end .. last but one), on the logits of each path, as every rank drew them
SAMPLE_PREFILL = "sample_prefill"          # [W, S, n] int64: W ranks, S = continuation tokens, n draws
SAMPLE_DECODE = "sample_decode"            # [W, S, n] int64, from the decode path's logits
SAMPLE_UNIFORMS = "sample_uniforms"        # [N] float64: the uniform each sampled generation step drew
# the last dim of COLLECTIVES
COLLECTIVE_SITES: tuple[str, ...] = ("dcp-q-gather", "dcp-lse-merge", "attn-allreduce", "mlp-allreduce")

# --- files of a run directory -------------------------------------------------------------------
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "tensors.safetensors"
LAYOUT_FILE = "layout.json"
CASES_FILE = "cases.json"
GSM8K_FILE = "gsm8k.json"
# disaggregated runs: the KV loads, pools, policy (harness/backends/embedded/worker_pd.py)
PD_RECORD_FILE = "pd.json"
PD_TENSORS_FILE = "pd.safetensors"    # ... the digests sent and held, the prefill world's first-token top-k
PD_STORE_DIR = "kvstore"              # ... the KV store between its two worlds (harness/engine/pd/store.py)
JOB_FILE = "job.json"
LAUNCHER_LOG = "launcher.log"
RUN_FILES: tuple[str, ...] = (MANIFEST_FILE, TENSORS_FILE, LAYOUT_FILE, CASES_FILE, GSM8K_FILE, LAUNCHER_LOG)

# --- layout.json: {"schema_version", "target": ENTRY, "speculator": ENTRY | null, "<entry>_reason"?}, an ENTRY
# {"ranks": [RankReport.to_json()], "pool", ...} (harness/records/rankreport.py is the schema of a rank's report)
LAYOUT_SCHEMA_KEY = "schema_version"    # the rank report schema the file was written in; absent: 1
LAYOUT_SCHEMA = RANK_REPORT_SCHEMA

# --- manifest fields the harness reads across backends ---------------------------------------------
MANIFEST_BACKEND = "backend"           # {"name", "version", "capabilities": Capabilities.to_dict()}
MANIFEST_PROMPTS_HASH = "prompts_hash"  # sha256 of the teacher-forced token id sequences
MANIFEST_WEIGHTS_HASH = "weights_hash"  # hash of the weights the engine loaded
MANIFEST_TOKENIZER_HASH = "tokenizer_hash"  # hash of the tokenizer (vocabulary and merges)
# non-finite logprobs an engine answered, as it spelled them ("null", "NaN", "Infinity"); their tensors hold
# NaN / inf there: [{"case", "kind" (tensor kind), "row", "token", "value"}]
MANIFEST_LOGPROB_VALUES = "nonfinite_logprobs"


def tensor_key(kind: str, case: int) -> str:
    """The safetensors key of tensor `kind` for case `case`, e.g. 'prefill_logits.3'."""
    return f"{kind}.{case}"

# --- capabilities a backend may declare ---------------------------------------------------------
FULL_LOGITS = "full_logits"            # prefill_logits / decode_logits over the whole vocabulary
TOPK_LOGPROBS = "topk_logprobs"        # *_topk_ids / *_topk_logprobs (k = Capabilities.top_k)
PROMPT_LOGPROBS = "prompt_logprobs"    # teacher-forced logprobs of the prompt (prefill path)
DECODE_PATH = "decode_path"            # teacher-forced logprobs through one-token decode steps
HIDDEN_STATES = "hidden_states"        # hidden.{i}
ATTENTION_OUTPUTS = "attention_outputs"  # attn.{i}
COLLECTIVE_ERRORS = "collective_errors"  # collectives.{i}
LAYOUT_REPORT = "layout_report"        # layout.json with each rank's heads and pool
KV_POOL_SIZE = "kv_pool_size"          # the KV pool size (blocks / bytes) the engine allocated
ACCEPT_TRACES = "accept_traces"        # spec_accepted.{i} per verify step
ACCEPTANCE_AGGREGATE = "acceptance_aggregate"  # only a mean acceptance length (manifest)
GENERATION = "generation"              # greedy generation with top-k logprobs
GSM8K = "gsm8k"                        # lm-eval GSM8K records
WORKLOADS = "workloads"                # runs Job.workloads (their cases, schedules and routes)
SCHEDULE_TWIN = "schedule_twin"        # twin_* of workload runs: the same prompts in one plain batch
REPREFILL = "reprefill"                # reprefill_topk_* of workload runs
RANK_DRAWS = "rank_draws"              # sample_* hold every rank's own draws (W = the ranks; an HTTP server: rank 0's)
SEEDED_SAMPLING = "seeded_sampling"    # a sampled request's own seed decides its draws (the same seed, the same tokens)

ALL_CAPABILITIES: tuple[str, ...] = (
    FULL_LOGITS, TOPK_LOGPROBS, PROMPT_LOGPROBS, DECODE_PATH, HIDDEN_STATES, ATTENTION_OUTPUTS, COLLECTIVE_ERRORS,
    LAYOUT_REPORT, KV_POOL_SIZE, ACCEPT_TRACES, ACCEPTANCE_AGGREGATE, GENERATION, GSM8K, WORKLOADS, SCHEDULE_TWIN,
    REPREFILL, RANK_DRAWS, SEEDED_SAMPLING,
)
# Every artifact of the contract in full (the embedded engine's; what a run that records no backend is read
# as): full logits carry every top-k, so no *_topk_* tensors; accept traces, not only their mean.
FULL_ARTIFACTS: frozenset[str] = frozenset(ALL_CAPABILITIES) - {ACCEPTANCE_AGGREGATE, TOPK_LOGPROBS}

# --- how a backend measures the noise floor tolerances scale with --------------------------------
NOISE_PRECISION_TWIN = "precision-twin"  # the reference recomputed in a higher precision
NOISE_SCHEDULING = "scheduling"          # two reference runs differing only in batching/scheduling
NOISE_NONE = "none"                      # no noise run: tolerances fall back to their floors
NOISE_REDUCTION_ORDER = "reduction-order"  # the reference in the same dtype with another reduction order

# --- how a backend sends a job's cases (Job.schedule) ---------------------------------------------
SCHEDULE_BATCHED = "batched"        # every case at once (the engine batches them)
SCHEDULE_SEQUENTIAL = "sequential"  # one case at a time: the NOISE_SCHEDULING twin of a reference


@dataclass(frozen=True)
class Capabilities:
    """What a backend can produce. `top_k` is the number of logprobs per position it returns. `batch_invariant`:
    the engine declares bitwise batch invariance and deterministic inference (a request's logprobs do not depend on
    what else is in its batch, nor on the run), so the route checks hold it to exact equality (docs/checks.md)."""

    provides: frozenset[str]
    top_k: int = 5
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(self.provides - set(ALL_CAPABILITIES))
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}; valid: {', '.join(ALL_CAPABILITIES)}")

    def has(self, capability: str) -> bool:
        return capability in self.provides

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"provides": sorted(self.provides), "top_k": self.top_k}
        if self.batch_invariant:  # absent when not declared: other engines' manifests stay as they were
            out["batch_invariant"] = True
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Capabilities":
        return cls(provides=frozenset(data.get("provides", ())), top_k=int(data.get("top_k", 5)),
                   batch_invariant=data.get("batch_invariant") is True)


@dataclass(frozen=True)
class GSM8KJob:
    """GSM8K in a run: the suite's GSM8K settings as `GSM8KSettings.to_dict` wrote them (the worker parses
    them with harness.gsm8k.settings.gsm8k_settings: the gsm8k package lies above the contract) and the
    local data file (None: lm-eval's dataset)."""

    settings: Mapping[str, Any]
    data_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"settings": copy.deepcopy(dict(self.settings)), "data_path": self.data_path}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GSM8KJob:
        check_keys("job gsm8k", data, ("settings", "data_path"), required=("settings",))
        if not isinstance(data["settings"], Mapping):
            raise ConfigError(f"job gsm8k: settings must be a mapping, got {data['settings']!r}")
        path = data.get("data_path")
        return cls(settings=dict(data["settings"]), data_path=str(path) if path is not None else None)


@dataclass(frozen=True)
class Job:
    """Everything one run needs, written by the runner as job.json in the run directory. Every field is
    typed (the specs themselves); `to_dict` / `from_dict` (and to_json / from_json) are its one
    serialization, used only at the process boundary (job.json, the reference cache's key, replay's match)."""

    model: ModelSpec
    topology: Topology
    prompts: tuple[str, ...]
    out_dir: str
    fault: str | None = None
    dtype: str | None = None
    seed: int = 0
    max_new_tokens: int = 16
    decode_prefix_tokens: int = 4
    top_k: int = 5
    pool: PoolSettings = PoolSettings()
    device: str = "cpu"
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    git_commit: str = ""
    gsm8k: GSM8KJob | None = None
    # how the topology's speculator speculates; None when the topology has none
    speculative: SpeculativeSettings | None = None
    schedule: str = SCHEDULE_BATCHED
    # how an HTTP run sends the cases' requests (harness/backends/http/send.py: one-at-a-time, all-at-once,
    # staggered, with parameters); None: all cases in one request (one at a time for the noise twin)
    request_schedule: SendSchedule | None = None
    # the workloads whose cases the run holds, in case order, resolved; each names how its requests are
    # sent ("schedule", "join_per_step"). (): the suite's prompts only
    workloads: tuple[Workload, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(self.prompts))
        object.__setattr__(self, "workloads", tuple(self.workloads))
        if self.schedule not in (SCHEDULE_BATCHED, SCHEDULE_SEQUENTIAL):
            raise ConfigError(f"job schedule {self.schedule!r} is not one of {SCHEDULE_BATCHED}, "
                              f"{SCHEDULE_SEQUENTIAL}")

    def to_dict(self) -> dict[str, Any]:
        """The job as JSON-ready data (what job.json holds): every field, each typed part by its own to_dict."""
        return {"model": self.model.to_dict(), "topology": self.topology.to_dict(), "prompts": list(self.prompts),
                "out_dir": self.out_dir, "fault": self.fault, "dtype": self.dtype, "seed": self.seed,
                "max_new_tokens": self.max_new_tokens, "decode_prefix_tokens": self.decode_prefix_tokens,
                "top_k": self.top_k, "pool": self.pool.to_dict(), "device": self.device,
                "collective_timeout_s": self.collective_timeout_s, "git_commit": self.git_commit,
                "gsm8k": self.gsm8k.to_dict() if self.gsm8k is not None else None,
                "speculative": self.speculative.to_dict() if self.speculative is not None else {},
                "schedule": self.schedule,
                "request_schedule": self.request_schedule.to_dict() if self.request_schedule is not None else None,
                "workloads": [w.to_dict() for w in self.workloads]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        """The job `to_dict` wrote, every part parsed (and validated) back into its type. A job.json of an
        earlier harness reads too (a pool with some keys: the rest take their defaults)."""
        names = tuple(f.name for f in fields(cls))
        check_keys("job", data, names, required=("model", "topology", "prompts", "out_dir"))
        rest = {k: v for k, v in data.items() if k not in ("model", "topology", "pool", "gsm8k", "speculative",
                                                           "workloads", "prompts", "request_schedule")}
        sends = data.get("request_schedule")
        return cls(model=model_from_dict("job", data["model"]),
                   topology=Topology.from_dict(data["topology"], where="job topology"),
                   prompts=tuple(str(p) for p in data["prompts"]),
                   pool=PoolSettings.from_dict(data.get("pool") or {}, where="job pool"),
                   gsm8k=GSM8KJob.from_dict(data["gsm8k"]) if data.get("gsm8k") else None,
                   speculative=(SpeculativeSettings.from_mapping(data["speculative"], "job speculative")
                                if data.get("speculative") else None),
                   workloads=tuple(Workload.from_dict(w) for w in data.get("workloads") or ()),
                   request_schedule=SendSchedule.parse(sends) if sends is not None else None, **rest)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: Path) -> Job:
        return cls.from_dict(read_json(path))


@dataclass(frozen=True)
class LaunchResult:
    """How one run ended. `ok` means the run directory holds a manifest with status "ok". `refused`:
    the engine said it cannot run this job (its own error line); the cell is a SKIP, not an ERROR."""

    ok: bool
    returncode: int | None
    wall_s: float
    error: str
    log_tails: dict[str, str]
    refused: str = ""


@runtime_checkable
class Backend(Protocol):
    """An engine the harness can drive. Implementations live in harness/backends/ or in a separate
    package registered under the `harness.backends` entry point group, and subclass this protocol: the
    optional parts (engine_build, engine_env, engine_fault) have defaults here that say the backend has
    no such feature, so a backend defines only what it has."""

    name: str

    def version(self) -> str:
        """The engine's version string (recorded in manifests and results)."""
        ...

    def capabilities(self) -> Capabilities:
        """Which artifacts its runs contain."""
        ...

    def identity(self, job: Job) -> dict[str, Any]:
        """What, besides the job, decides the artifacts of a run: engine name and version and the
        weights (never the harness's compare code). The reference cache is keyed by it."""
        ...

    def skip_reason(self, model: Any, topology: Any) -> str | None:
        """Why this engine cannot run `model` at `topology` (a SKIP with that reason), or None."""
        ...

    def noise_strategy(self) -> str:
        """One of NOISE_PRECISION_TWIN, NOISE_SCHEDULING, NOISE_REDUCTION_ORDER, NOISE_NONE."""
        ...

    def run(self, job: Job, timeout_s: float) -> LaunchResult:
        """Run `job`, writing the run directory at job.out_dir; always leaves a manifest.json."""
        ...

    # -- optional: the defaults say the backend has no such feature ------------------------------------

    def engine_build(self) -> str:
        """The build label of the engine it runs (harness/backends/build.py); '' when it names none."""
        return ""

    def engine_env(self) -> dict[str, str]:
        """The engine's own environment variables its runs use (an HTTP template's engine_env); {} when none."""
        return {}

    def engine_fault(self) -> str | None:
        """"VAR=VALUE" of the engine-side fault variables set for its runs (template engine_faults); None
        when it injects none."""
        return None

    def as_reference(self) -> Backend:
        """This engine in the reference role (the tp1 reference and its noise run): the same engine without what
        injects a fault into the build under test (an HTTP template's engine_faults); itself when it has none."""
        return self

    def machine_backend(self, model: Any) -> dict[str, Any] | None:
        """The backend the engine runs `model`'s attention with on this machine ({"attention", "backend",
        "chosen_by"[, "source"]}: recorded in the report), or None when it depends on no machine."""
        return None

    def workload_skip(self, topology: Any, workload: Any) -> str | None:
        """Why this engine cannot run `workload` (a resolved harness.specs.workload.Workload) at `topology`: that
        workload's cells are a SKIP with this reason, decided before any launch, and its runs of the topology leave
        the workload out. None (the default): it runs every workload its capabilities name."""
        return None

    def independent_runs(self) -> bool:
        """Whether two of its runs may be in flight at once (each launch its own processes: a reference and its
        noise run then overlap). False (the default): its runs share something, e.g. an HTTP engine's server."""
        return False

    def reseeds_weights(self) -> bool:
        """Whether a run seed also reseeds a synthetic model's weights (True: each launch builds its weights anyway,
        so seeds cover other models too). An engine serving from a server says False: the run seed seeds the cases
        and each request's sampling, the weights are the model's own (its spec's `seed`), and one server serves
        every seed."""
        return True


def recorded_capabilities(manifest: dict[str, Any]) -> Capabilities | None:
    """The capabilities a run's manifest records (its backend entry), or None when it records none."""
    entry = manifest.get(MANIFEST_BACKEND)
    if not isinstance(entry, dict) or not isinstance(entry.get("capabilities"), dict):
        return None
    return Capabilities.from_dict(entry["capabilities"])
