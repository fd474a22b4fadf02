"""Suite: which models, topologies, prompts and checks one matrix runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from harness.core.errors import ConfigError
from harness.core.limits import MAX_SEED
from harness.core.paths import SUITES_DIR
from harness.specs.loader import build, check_path_name, did_you_mean, expect_int, load_yaml
from harness.specs.topology import parse_topology_name
from harness.specs.workload import SUITE_PROMPTS, Workload, check_workload_names, workload

ENABLED_KEY = "enabled"  # every `checks:` section's switch: `checks: {SECTION: {enabled: false}}`


@dataclass(frozen=True)
class Suite:
    """One suite file. `checks` maps a check section to its settings (tolerances per dtype etc.): their
    shape is checked here, the section names and their keys against the check registry
    (harness/checks/settings.py: load_suite)."""

    name: str
    version: int
    models: tuple[str, ...]
    topologies: tuple[str, ...]
    prompts: tuple[str, ...]
    description: str = ""
    reference: str = "tp1"
    seeds: tuple[int, ...] = (0,)
    max_new_tokens: int = 16
    decode_prefix_tokens: int = 4
    kv_budget_mib: int = 64
    max_seq_len: int = 512
    checks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    gsm8k: Mapping[str, Any] = field(default_factory=dict)
    speculative: Mapping[str, Any] = field(default_factory=dict)
    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    workloads: tuple[str, ...] = (SUITE_PROMPTS,)  # the workload axis (harness/specs/workload.py: WORKLOADS)
    long_context: int = 136                       # tokens of the workloads' long prompt
    # engine name -> models a run on that engine (its parallel engine) adds to `models` when no --model is given:
    # ones it loads where the suite's own it cannot (vLLM's CPU MLA takes one latent width and, on an AMX CPU,
    # half-precision weights only); the suite's own models stay, a SKIP naming why where the engine cannot run them
    engine_models: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"suite {self.name!r}"
        check_path_name(where, "name", self.name)  # names the default report folder
        object.__setattr__(self, "workloads", check_workload_names(where, self.workloads))
        expect_int(where, "long_context", self.long_context, minimum=1)
        expect_int(where, "version", self.version, minimum=1)
        expect_int(where, "max_new_tokens", self.max_new_tokens, minimum=1)
        expect_int(where, "decode_prefix_tokens", self.decode_prefix_tokens, minimum=1)
        expect_int(where, "kv_budget_mib", self.kv_budget_mib, minimum=1)
        expect_int(where, "max_seq_len", self.max_seq_len, minimum=1)
        for attr in ("models", "topologies", "prompts", "seeds"):
            value = getattr(self, attr)
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise ConfigError(f"{where}: {attr} must be a list, got {value!r}")
            object.__setattr__(self, attr, tuple(value))
        for attr in ("models", "topologies", "prompts"):
            bad = next((item for item in getattr(self, attr) if not isinstance(item, str)), None)
            if bad is not None:
                raise ConfigError(f"{where}: every item of {attr} must be a string, got {bad!r} (quote YAML "
                                  f"text holding ': ' or '#')")
        self._check_reference(where)
        if not self.models:
            raise ConfigError(f"{where}: models is empty")
        if not isinstance(self.engine_models, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(m, str) for m in v)
                for k, v in self.engine_models.items()):
            raise ConfigError(f"{where}: engine_models must map an engine name to a list of model names, "
                              f"got {self.engine_models!r}")
        object.__setattr__(self, "engine_models", {k: tuple(v) for k, v in self.engine_models.items()})
        if not self.topologies:
            raise ConfigError(f"{where}: topologies is empty")
        if not self.prompts and not self.gsm8k:
            raise ConfigError(f"{where}: needs prompts or gsm8k settings")
        if not self.seeds:
            raise ConfigError(f"{where}: seeds is empty")
        for seed in self.seeds:
            expect_int(where, "seed", seed, maximum=MAX_SEED)
        if not isinstance(self.checks, Mapping):
            raise ConfigError(f"{where}: checks must be a mapping of check name to settings")
        for check, settings in self.checks.items():
            if settings is not None and not isinstance(settings, Mapping):
                raise ConfigError(f"{where}: settings of check {check!r} must be a mapping, got {settings!r}")
            if not isinstance((settings or {}).get(ENABLED_KEY, True), bool):
                raise ConfigError(f"{where}: checks.{check}.{ENABLED_KEY} must be true or false, "
                                  f"got {settings[ENABLED_KEY]!r}")

    def _check_reference(self, where: str) -> None:
        """The reference is one plain world (tpN[dcpM], no speculator run, not a PREFILL>DECODE pair): a
        disaggregated reference would be read from the plain decode side's cache entry while its noise run is a
        P/D run, so the two would measure different things."""
        if not isinstance(self.reference, str):
            raise ConfigError(f"{where}: reference must be a topology name such as tp1, got {self.reference!r}")
        topo = parse_topology_name(self.reference)  # a bad name: the grammar's error
        if topo.prefill is not None:
            raise ConfigError(f"{where}: reference={self.reference!r} is a disaggregated PREFILL>DECODE topology; "
                              f"a reference must be one plain world (e.g. tp1)")

    def models_for(self, engine: str) -> tuple[str, ...]:
        """The models a run whose parallel engine is `engine` runs by default: `models`, then engine_models'."""
        return self.models + tuple(m for m in self.engine_models.get(engine, ()) if m not in self.models)

    def check_settings(self, check: str) -> Mapping[str, Any]:
        """The settings of section `check` (tolerances), without its `enabled` switch."""
        return {k: v for k, v in (self.checks.get(check) or {}).items() if k != ENABLED_KEY}

    def check_enabled(self, check: str) -> bool:
        """False when the suite switches section `check` off (`enabled: false`)."""
        return bool((self.checks.get(check) or {}).get(ENABLED_KEY, True))

    def resolved_workloads(self, names: tuple[str, ...] | None = None, hash_block: int = 0) -> tuple[Workload, ...]:
        """Workloads `names` (default: the suite's list), long_context and max_new_tokens filled in, each sized
        so its route can run at the run's largest prefix-cache hash block (`hash_block` tokens: block_size x the
        largest dcp; Workload.sized_for)."""
        return tuple(workload(n).resolved(self.long_context, self.max_new_tokens).sized_for(hash_block)
                     for n in names or self.workloads)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "models": list(self.models),
                "topologies": list(self.topologies), "reference": self.reference, "seeds": list(self.seeds),
                "max_new_tokens": self.max_new_tokens, "checks": dict(self.checks)}


PROFILE_KEYS: tuple[str, ...] = ("gsm8k", "max_new_tokens", "max_seq_len", "kv_budget_mib", "seeds", "topologies",
                                 "workloads", "long_context")


def with_profile(suite: Suite, profile: str | None) -> Suite:
    """The suite with profile `profile`'s settings laid over it (gsm8k settings merge key by key)."""
    if profile is None:
        return suite
    if profile not in suite.profiles:
        raise ConfigError(f"suite {suite.name!r} has no profile {profile!r}"
                          f"{did_you_mean(profile, tuple(suite.profiles))}; "
                          f"valid: {', '.join(suite.profiles) or '(none)'}")
    over = dict(suite.profiles[profile] or {})
    for key in over:
        if key not in PROFILE_KEYS:
            raise ConfigError(f"suite {suite.name!r} profile {profile!r}: unknown key {key!r}"
                              f"{did_you_mean(key, PROFILE_KEYS)}; valid: {', '.join(PROFILE_KEYS)}")
    if "gsm8k" in over:
        over["gsm8k"] = {**suite.gsm8k, **(over["gsm8k"] or {})}
    return replace(suite, **over)


def shipped_suites(folder: Path = SUITES_DIR) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def read_suite(ref: str, folder: Path = SUITES_DIR) -> Suite:
    """A suite by shipped name or by path to a suite YAML, its `checks:` not yet checked against the
    registry (harness/checks/settings.py: load_suite does both)."""
    shipped = shipped_suites(folder)
    if ref in shipped:
        path = shipped[ref]
    elif Path(ref).is_file():
        path = Path(ref)
    else:
        raise ConfigError(f"unknown suite {ref!r}{did_you_mean(ref, tuple(shipped))}; "
                          f"valid: {', '.join(shipped)} or a path to a suite .yaml")
    data = load_yaml(path) or {}
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    return build(Suite, str(path), data)
