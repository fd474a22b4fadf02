"""The check registry: every check of a cell, declared once: name, the suite `checks:` section holding
its settings and the settings class it parses them into, the capabilities it needs, which cells it
belongs to and the function that runs it. Built-in checks are listed here; a package adds its own
through the entry point group `harness.checks` (each entry point names a CheckSpec or a sequence of
them; see docs/checks.md):

    [project.entry-points."harness.checks"]
    my_check = "my_package.checks:SPEC"

This module imports nothing heavy: the suite's `checks:` keys (harness/checks/settings.py), CheckSettings,
`harness list checks` and the driver read the same registry. A check's function is imported only when a
cell runs it; it takes one CellContext (harness/checks/context.py) and returns a list of CheckResults
(a check may report several, e.g. gsm8k's paired and baseline checks, or none: localization only
explains a failure).

An unmet need is a SKIP naming the engine and the capability; `checks: {NAME: {enabled: false}}`
in a suite switches a section off (its checks are SKIPs saying so).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

from harness.compare.settings import (
    AcceptanceSettings,
    CollectiveSettings,
    ConsistencySettings,
    GenerationSettings,
    LayoutSettings,
    LocalizationSettings,
    LogitsSettings,
    LosslessSettings,
    SamplingSettings,
    ScheduleSettings,
    SelfConsistencySettings,
    SpeculativeOutputSettings,
)
from harness.core.errors import ConfigError
from harness.core.plugins import load_target, registered
from harness.records import contract as c

ENTRY_POINT_GROUP = "harness.checks"

CELL_KINDS: tuple[str, ...] = ("all", "speculative", "gsm8k", "route", "workloads", "teacher_forced", "pd",
                               "sampling")


@dataclass(frozen=True)
class CheckSpec:
    """One registered check."""

    name: str                              # the name results carry ("logits_decode")
    section: str                           # the suite `checks:` key of its settings ("logits")
    target: str                            # "module:function" taking a CellContext
    description: str
    settings: type | None = None           # the frozen dataclass its section parses into (None: only `enabled`)
    requires: tuple[str, ...] = ()         # capabilities needed, all of them
    requires_any: tuple[str, ...] = ()     # capabilities of which one suffices (e.g. full logits or top-k)
    cells: str = "all"                     # "all", "speculative" (-draft/-mtp cells), "gsm8k" (suites with gsm8k),
    #                                        "route" (cells whose workload's route is this check: Workload.route),
    #                                        "workloads" (cells of a run with workloads, Job.workloads),
    #                                        "teacher_forced" (cells whose workload takes no serving route of
    #                                        its own: the suite's prompts, lengths; a route workload's cell
    #                                        judges its generation route), "pd" (disaggregated PREFILL>DECODE cells),
    #                                        "sampling" (cells whose workload samples: Workload.sampling)
    performance_only: bool = False         # measures speed, not outputs: its FAIL is a performance regression
    reads_noise: bool = False              # its bounds scale from the noise run: its reason names the cell's noise
    #                                        source where that is not the reference engine's own noise run

    def __post_init__(self) -> None:
        unknown = [x for x in (*self.requires, *self.requires_any) if x not in c.ALL_CAPABILITIES]
        if unknown or self.cells not in CELL_KINDS:
            raise ValueError(f"check {self.name}: unknown capabilities {unknown} or cells {self.cells!r}")

    def needs(self) -> str:
        """'hidden_states' / 'full_logits|topk_logprobs + prompt_logprobs' / '-'."""
        parts = (["|".join(self.requires_any)] if self.requires_any else []) + list(self.requires)
        return " + ".join(parts) or "-"


_B = "harness.checks.builtin"
_W = "harness.checks.workload_checks"
BUILTIN_CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("inputs", "inputs", f"{_B}:inputs",
              "reference and parallel runs used the same prompt token ids, weights and tokenizer"),
    CheckSpec("layout", "layout", f"{_B}:layout",
              "each rank's heads, DCP groups, K/V checksums, Q->KV reads and KV pool against the planner "
              "(an HTTP engine: the KV capacity its server logged, speculator pool included)",
              settings=LayoutSettings, requires_any=(c.LAYOUT_REPORT, c.KV_POOL_SIZE)),
    CheckSpec("speculator_layout", "speculator_layout", f"{_B}:speculator_layout",
              "the draft/MTP model keeps the plain TP layout and its own KV pool",
              requires=(c.LAYOUT_REPORT,), cells="speculative"),
    CheckSpec("features_on", "features_on", "harness.checks.features:features_on",
              "the engine ran every route the cell asked for (tp, DCP size, placement, EP expert map, the workload's "
              "route, speculator), from its rank reports, route stats and spec-decode traces or counters"),
    CheckSpec("logits_prefill", "logits", f"{_B}:logits_prefill",
              "teacher-forced prefill logits: KL, abs/logprob error, top-1/top-k agreement, near ties",
              settings=LogitsSettings, requires=(c.PROMPT_LOGPROBS,), requires_any=(c.FULL_LOGITS, c.TOPK_LOGPROBS),
              cells="teacher_forced", reads_noise=True),
    CheckSpec("logits_decode", "logits", f"{_B}:logits_decode",
              "teacher-forced one-token decode steps through the KV cache, as logits_prefill; from engines "
              "without a decode path (HTTP), the generations' top-k along the common greedy prefix",
              settings=LogitsSettings, requires_any=(c.DECODE_PATH, c.GENERATION), cells="teacher_forced",
              reads_noise=True),
    CheckSpec("generation", "generation", f"{_B}:generation",
              "greedy tokens; a divergence is benign only at a near tie of the reference",
              settings=GenerationSettings, requires=(c.GENERATION,), reads_noise=True),
    CheckSpec("collectives", "collectives", f"{_B}:collectives",
              "each all-reduce, DCP Q gather and LSE merge against an exact recompute from its own inputs, "
              "bounded by the model dtype's rounding (catches a collective done in a lower precision)",
              settings=CollectiveSettings, requires=(c.COLLECTIVE_ERRORS,), cells="teacher_forced"),
    CheckSpec("localization", "localization", f"{_B}:localization",
              "when a parity or collectives check fails: the first diverging layer or collective, its heads, "
              "their ranks and KV heads",
              settings=LocalizationSettings, requires=(c.HIDDEN_STATES,), cells="teacher_forced", reads_noise=True),
    CheckSpec("lossless", "lossless", f"{_B}:lossless",
              "speculative greedy output equals plain greedy output of the same run",
              settings=LosslessSettings, requires=(c.GENERATION,), cells="speculative", reads_noise=True),
    CheckSpec("speculative_logprobs", "speculative_output", f"{_B}:speculative_logprobs",
              "what a speculative server returns per step (tokens, top-k logprobs) against the plain server of the "
              "same setting, and (speculative_consistency) its decode-time top-k against its own re-prefill",
              settings=SpeculativeOutputSettings, requires=(c.GENERATION,), cells="speculative"),
    CheckSpec("acceptance", "acceptance", f"{_B}:acceptance",
              "mean accepted length and per-prompt accept traces against the reference with the same speculator, "
              "and acceptance_baseline against baselines/acceptance.yaml",
              settings=AcceptanceSettings, requires_any=(c.ACCEPT_TRACES, c.ACCEPTANCE_AGGREGATE), cells="speculative",
              performance_only=True),
    CheckSpec("acceptance_per_position", "acceptance", "harness.checks.acceptance_position:acceptance_per_position",
              "each draft position's acceptance rate (per-step traces, or vLLM's per-position counters) against the "
              "stored baseline's histogram, else 0.95 x the reference's, by GSM8K's one-sided test",
              settings=AcceptanceSettings, requires_any=(c.ACCEPT_TRACES, c.ACCEPTANCE_AGGREGATE), cells="speculative",
              performance_only=True),
    CheckSpec("reference_baseline", "reference_baseline", f"{_B}:reference_baseline",
              "the reference against its recording from an earlier build (baselines/references.yaml): top-k "
              "logprobs of both paths, greedy tokens, draft proposals and accept counts, per-layer summaries, within "
              "the dtype's rounding; a difference is 'the reference changed since build X'"),
    CheckSpec("gsm8k", "gsm8k", f"{_B}:gsm8k",
              "gsm8k_paired (McNemar, answer agreement) and gsm8k_baseline (hypothesis test) per cell",
              requires=(c.GSM8K,), cells="gsm8k"),
    *(CheckSpec(name, "schedule", f"{_W}:{name}",
                f"the run against itself, {what}: greedy tokens equal but at near ties, logprobs within noise "
                f"(the {route} workload)", settings=ScheduleSettings, requires=(c.GENERATION, c.SCHEDULE_TWIN),
                cells="route", reads_noise=True)
      for name, what, route in (
          ("batch_invariance", "staggered into a running batch vs one batch", "concurrent"),
          ("prefix_cache", "from cached prefix blocks vs computed", "prefix-cache"),
          ("chunked_prefill", "prefilled in chunks vs whole", "chunked-prefill"),
          ("preemption", "preempted and recomputed vs uninterrupted", "preemption"))),
    CheckSpec("self_consistency", "self_consistency", f"{_W}:self_consistency",
              "the run against itself, no reference: each prompt sent again into reused slots and state pages, "
              "in another order and alone, against its first copy and its one-batch twin (the self-consistency "
              "workload)", settings=SelfConsistencySettings, requires=(c.GENERATION, c.SCHEDULE_TWIN), cells="route",
              reads_noise=True),
    CheckSpec("pd_transfer", "pd", "harness.checks.pd:pd_transfer",
              "disaggregated cells: every KV row each decode rank holds after placement against the digest the prefill "
              "side took when it computed it, where the transfer plan puts it (heads, DCP token rows, MLA latent); a "
              "mismatch names request, block, layer, heads and ranks", cells="pd"),
    CheckSpec("pd_load", "pd", "harness.checks.pd:pd_load",
              "disaggregated cells: the KV load path: attempts within the policy's bound, no failed load reported "
              "loaded, recompute from position 0, no wait past the deadline, every KV pool balanced at the end",
              cells="pd"),
    CheckSpec("pd_consistency", "pd", "harness.checks.pd:pd_consistency",
              "disaggregated cells, no reference: the prefill world's first new token against the decode world's "
              "(top-1 equal except at near ties, top-1 logprob within 0.05 nats)", requires=(c.GENERATION,),
              cells="pd"),
    CheckSpec("decode_consistency", "decode_consistency", f"{_W}:decode_consistency",
              "each generated step's decode-time top-k against a re-prefill of prompt + generated tokens of the "
              "same run (no reference needed)", settings=ConsistencySettings, requires=(c.GENERATION, c.REPREFILL),
              cells="workloads", reads_noise=True),
    CheckSpec("sampling_distribution", "sampling", "harness.checks.sampling_checks:sampling_distribution",
              "each teacher-forced position's n draws of the parallel run's sampler (prefill and decode path) against "
              "the reference's processed distribution (full logits: no token outside its support but near ties, and a "
              "chi-square fit; top-k-only engines: a two-sample chi-square against the reference server's own draws) "
              "at a false-positive rate of alpha per cell", settings=SamplingSettings, cells="sampling",
              reads_noise=True),
    CheckSpec("sampling_ranks", "sampling", "harness.checks.sampling_checks:sampling_ranks",
              "every rank's sampler drew the same tokens at every position (no exchange needed when ranks agree)",
              settings=SamplingSettings, requires=(c.RANK_DRAWS,), cells="sampling"),
    CheckSpec("sampling_seeded", "sampling", "harness.checks.sampling_checks:sampling_seeded",
              "a prompt sent again with the same seed, alone instead of in a batch, generated the same tokens",
              settings=SamplingSettings, requires=(c.GENERATION, c.SEEDED_SAMPLING), cells="sampling"),
)

def _specs_of(entry: str, obj: Any) -> list[CheckSpec]:
    specs = list(obj) if isinstance(obj, Sequence) else [obj]
    if not specs or not all(isinstance(spec, CheckSpec) for spec in specs):
        raise ConfigError(f"check entry point {entry!r} ({ENTRY_POINT_GROUP}) names {obj!r}, not a CheckSpec "
                          "or a sequence of CheckSpecs")
    return specs


@functools.lru_cache(maxsize=1)
def registered_checks() -> tuple[CheckSpec, ...]:
    """Every check: the built-ins, then those of the `harness.checks` entry points. Names are unique, and
    the checks sharing a section share its settings class."""
    specs = list(BUILTIN_CHECKS)
    for entry in registered(ENTRY_POINT_GROUP):
        specs += _specs_of(f"{entry.name} = {entry.target} ({entry.origin})", load_target(entry.target))
    names: set[str] = set()
    classes: dict[str, type | None] = {}
    for spec in specs:
        if spec.name in names:
            raise ConfigError(f"check {spec.name!r} is registered twice (entry point group {ENTRY_POINT_GROUP})")
        names.add(spec.name)
        if classes.setdefault(spec.section, spec.settings) is not spec.settings:
            raise ConfigError(f"check {spec.name!r}: section {spec.section!r} is parsed by "
                              f"{getattr(classes[spec.section], '__name__', None)} for another check, "
                              f"not {getattr(spec.settings, '__name__', None)}")
    return tuple(specs)


def sections() -> dict[str, type | None]:
    """The suite `checks:` keys, in registry order, with the settings class each parses into (None: the
    section takes nothing but `enabled`; gsm8k's settings are the suite's top-level `gsm8k:`)."""
    return {spec.section: spec.settings for spec in registered_checks()}


def check_spec(name: str) -> CheckSpec:
    return next(spec for spec in registered_checks() if spec.name == name)
