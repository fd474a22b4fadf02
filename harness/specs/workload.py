"""Workloads: what a cell sends to the engine and how, as plain data (a matrix axis next to topologies).

A workload names its prompts (the suite's own prompts, or seeded prompts of exact token lengths, some
sharing a prefix), how many tokens each generates, how its requests are scheduled (`SCHEDULES`) and
which serving route of the engine it exercises (prefix cache, chunked prefill, preemption under a small
KV pool). The embedded engine runs every route itself (harness/engine/runtime/scheduler.py); an HTTP backend
reads `schedule` / `join_per_step` from the job and sends the requests accordingly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from harness.core.errors import ConfigError
from harness.specs.loader import did_you_mean
from harness.specs.sampling import SamplingParams

# how a workload's requests reach the engine (Workload.schedule; helper backends read the same strings)
ONE_AT_A_TIME = "one-at-a-time"  # each request alone, the next after the previous finished
ALL_AT_ONCE = "all-at-once"      # every request at once (the engine batches them)
STAGGERED = "staggered"          # `join_per_step` requests join the running batch per engine step
SCHEDULES: tuple[str, ...] = (ONE_AT_A_TIME, ALL_AT_ONCE, STAGGERED)

SUITE_PROMPTS = "prompts"  # the workload of the suite's own `prompts:` list
LONG = -1                  # a prompt length standing for the suite's long_context (Suite.long_context)


@dataclass(frozen=True)
class Workload:
    """One workload. `lengths` are prompt lengths in tokens (LONG: the suite's long_context); with
    `shared_prefix` every prompt starts with the same that many tokens; `repeat_first` sends the first
    prompt again at the end (a whole-prompt cache hit). Engine routes: `prefix_cache` (reuse cached KV
    blocks by block hash), `chunk_tokens` (a token budget per engine step: longer prompts prefill in
    chunks), `kv_tokens` (a KV pool that holds this many tokens: the engine preempts and recomputes).
    `new_tokens` 0 means the suite's max_new_tokens; `route` names the self-check the workload feeds.
    `order` sends the prompts of `lengths` by index, a prompt possibly several times (the same tokens each
    time; () sends each once), and `arrivals` gives each send's engine step (() : by `schedule`). `sampling`
    (None: greedy) makes every request of the workload sample (harness/specs/sampling.py)."""

    name: str
    description: str
    schedule: str = ALL_AT_ONCE
    join_per_step: int = 1
    lengths: tuple[int, ...] = ()
    new_tokens: int = 0
    shared_prefix: int = 0
    repeat_first: bool = False
    prefix_cache: bool = False
    chunk_tokens: int = 0
    kv_tokens: int = 0
    route: str = ""
    order: tuple[int, ...] = ()
    arrivals: tuple[int, ...] = ()
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"workload {self.name!r}: schedule {self.schedule!r} is not one of "
                              f"{', '.join(SCHEDULES)}{did_you_mean(self.schedule, SCHEDULES)}")
        if self.join_per_step < 1:
            raise ConfigError(f"workload {self.name!r}: join_per_step={self.join_per_step} must be >= 1")
        bad = [n for n in self.lengths if n != LONG and n < 1]
        if bad:
            raise ConfigError(f"workload {self.name!r}: prompt lengths {bad} must be >= 1 token")
        if any(not 0 <= i < len(self.lengths) for i in self.order):
            raise ConfigError(f"workload {self.name!r}: order {list(self.order)} must index its "
                              f"{len(self.lengths)} prompt lengths (0..{len(self.lengths) - 1})")
        if self.arrivals and (len(self.arrivals) != len(self.sent()) or any(a < 0 for a in self.arrivals)
                              or list(self.arrivals) != sorted(self.arrivals)):
            raise ConfigError(f"workload {self.name!r}: arrivals {list(self.arrivals)} must give one engine "
                              f"step >= 0 to each of its {len(self.sent())} sends, in send order (never decreasing)")

    @property
    def suite_prompts(self) -> bool:
        return not self.lengths

    def resolved(self, long_context: int, max_new_tokens: int) -> Workload:
        """The workload with LONG replaced by `long_context` and new_tokens defaulted."""
        lengths = tuple(long_context if n == LONG else n for n in self.lengths)
        return replace(self, lengths=lengths, new_tokens=self.new_tokens or max_new_tokens)

    def sized_for(self, hash_block: int) -> Workload:
        """The workload with its route runnable at a hash block of `hash_block` tokens (block_size x dcp: a
        prefix cache hits only whole such blocks): a shared prefix shorter than one block is lengthened to one
        (a 72-token prefix at dcp 8, blocks of 16 x 8 = 128 tokens, could never hit)."""
        if self.prefix_cache and 0 < self.shared_prefix < hash_block:
            return replace(self, shared_prefix=hash_block)
        return self

    def sent(self) -> tuple[int, ...]:
        """Index into `lengths` of every send, in send order (repeat_first last)."""
        order = self.order or tuple(range(len(self.lengths)))
        return order + (order[:1] if self.repeat_first and order else ())

    def prompt_lengths(self) -> tuple[int, ...]:
        """Every prompt's length in tokens, in send order (shared prefix included, repeat last)."""
        return tuple(self.shared_prefix + self.lengths[i] for i in self.sent())

    def engine_settings(self) -> dict[str, Any]:
        """The engine settings this workload runs under (recorded in the manifest)."""
        return {"schedule": self.schedule, "join_per_step": self.join_per_step, "prefix_cache": self.prefix_cache,
                "chunk_tokens": self.chunk_tokens, "kv_tokens": self.kv_tokens, "arrivals": list(self.arrivals)}

    def request_seeds(self) -> tuple[int, ...]:
        """Each send's sampling seed (a prompt sent twice draws with the same seed); () when greedy."""
        if self.sampling is None:
            return ()
        return tuple(self.sampling.request_seed(i) for i in self.sent())

    def sends(self, suite_prompts: int = 0) -> str:
        """What the workload sends, in words (harness list workloads)."""
        if self.suite_prompts:
            what = f"the suite's {suite_prompts or ''} prompts".replace("  ", " ")
        else:
            lengths = ", ".join("long_context" if n == LONG else str(n) for n in self.lengths)
            what = f"{len(self.prompt_lengths())} prompts of {lengths} tokens"
            if self.shared_prefix:
                what += f" after a shared {self.shared_prefix}-token prefix"
            if self.repeat_first:
                what += ", the first sent twice"
            if self.order:
                what += f" (sent as prompts {', '.join(map(str, self.order))})"
        new = f"{self.new_tokens} new tokens" if self.new_tokens else "max_new_tokens new tokens"
        how = self.schedule + (f" ({self.join_per_step} joining per step)" if self.schedule == STAGGERED else "")
        how += f", arriving at engine steps {', '.join(map(str, self.arrivals))}" if self.arrivals else ""
        routes = [r for r, on in (("prefix cache", self.prefix_cache),
                                  (f"chunked prefill of {self.chunk_tokens} tokens per step", self.chunk_tokens),
                                  (f"a KV pool of {self.kv_tokens} tokens (preemption)", self.kv_tokens)) if on]
        sampled = f"; sampled ({self.sampling.describe()})" if self.sampling is not None else ""
        return f"{what}, {new}, {how}" + (f"; {', '.join(routes)}" if routes else "") + sampled

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "description": self.description, "schedule": self.schedule,
               "join_per_step": self.join_per_step, "lengths": list(self.lengths), "new_tokens": self.new_tokens,
               "shared_prefix": self.shared_prefix, "repeat_first": self.repeat_first,
               "prefix_cache": self.prefix_cache, "chunk_tokens": self.chunk_tokens, "kv_tokens": self.kv_tokens,
               "route": self.route, "order": list(self.order), "arrivals": list(self.arrivals)}
        if self.sampling is not None:  # absent when greedy: the greedy workloads' serialized jobs stay as they were
            out["sampling"] = self.sampling.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workload:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"workload entry: unknown keys {unknown}; valid: {', '.join(sorted(known))}")
        rest = dict(data)
        for key in ("lengths", "order", "arrivals"):
            rest[key] = tuple(rest.get(key, ()))
        if rest.get("sampling") is not None:
            rest["sampling"] = SamplingParams.from_dict(rest["sampling"])
        return cls(**rest)


# prompt lengths one past the KV block size (16), dcp - 1 for dcp 2..4, one past dcp x block size (64 at dcp 4)
# and 128, and one long prompt (the suite's long_context, 136 by default); the full sweep also sits on each boundary
_STRADDLE: tuple[int, ...] = (1, 3, 17, 65, 129, LONG)
_STRADDLE_FULL: tuple[int, ...] = (1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 127, 128, 129, LONG)

# self-consistency: three prompts (5, 13, 21 tokens) sent three times in one lane, each send generating 6
# tokens (whole prefill at step s, last token at s + 5, closed then): first together with three fillers (27, 9, 17
# tokens) at step 0; again at step 8, in reverse order, into the slots and state pages the six freed (the
# pools hand out the most recently freed first); then each alone in its lane at steps 16, 24 and 32, after
# the previous one finished (another workload's sequences may still share those engine steps).
_SELF_CONSISTENCY = ("the same three prompts sent three times: first in one batch with three fillers, then in "
                     "reverse order into the KV slots and recurrent-state pages the first six freed, then each "
                     "alone; self_consistency holds the copies (and the one-batch twin) against each other")

# sampling: three prompts (6, 11 and 17 tokens) sampled together at step 0, the first one again alone at step 12
# (after the batch finished: same prompt, same seed, so the same tokens); every teacher-forced position of each
# case is also drawn from n = 400 times (the distribution check's sample; its power: docs/checks.md#sampling)
_SAMPLING = ("three prompts sampled with temperature, min-p, top-k, top-p and penalties, the first sent again alone "
             "with the same seed; the sampling checks test each position's draws against the reference's "
             "processed distribution, the ranks' agreement and the seeded copies' equality")
SAMPLING = SamplingParams(temperature=1.5, top_k=12, top_p=0.95, min_p=0.05, repetition_penalty=1.3,
                          presence_penalty=0.5, frequency_penalty=0.2, seed=7, n=400)

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(SUITE_PROMPTS, "the suite's own prompts in one batch"),
    Workload("lengths", "prompt lengths one past the KV block size, dcp - 1, one past dcp x block size and 128, "
             "plus one long prompt (long_context); generations cross block boundaries", lengths=_STRADDLE),
    Workload("lengths-full", "the lengths sweep on and around every boundary: block size, dcp - 1 and dcp x block "
             "size for dcp 2..4, 128, and the long prompt (the nightly profiles)", lengths=_STRADDLE_FULL),
    Workload("concurrent", "mixed-length prompts arriving one per engine step, so each joins a running batch "
             "(continuous batching); batch_invariance compares them with the same prompts in one batch",
             schedule=STAGGERED, lengths=(5, 17, 40, 9), new_tokens=8, route="batch_invariance"),
    Workload("prefix-cache", "prompts sharing a 72-token prefix, sent after the first one's prefill cached it "
             "(block-hash hits: whole blocks of block_size x dcp tokens), and the first prompt again",
             schedule=STAGGERED, lengths=(3, 12, 7), shared_prefix=72, repeat_first=True, prefix_cache=True,
             new_tokens=8, route="prefix_cache"),
    Workload("chunked-prefill", "a long prompt (long_context) prefilled in chunks of a 48-token budget per step, "
             "next to a short prompt decoding in the same steps", lengths=(LONG, 6), chunk_tokens=48, new_tokens=8,
             route="chunked_prefill"),
    Workload("self-consistency", _SELF_CONSISTENCY, lengths=(5, 13, 21, 27, 9, 17), new_tokens=6,
             order=(0, 1, 2, 3, 4, 5, 2, 1, 0, 0, 1, 2), arrivals=(0, 0, 0, 0, 0, 0, 8, 8, 8, 16, 24, 32),
             route="self_consistency"),
    Workload("preemption", "more concurrent sequences than a 160-token KV pool holds once they grow: the engine "
             "preempts the newest and recomputes it (prompt + its tokens so far) when there is room",
             lengths=(40, 33, 50, 24), kv_tokens=160, new_tokens=10, route="preemption"),
    Workload("sampling", _SAMPLING, lengths=(6, 11, 17), new_tokens=8, order=(0, 1, 2, 0), arrivals=(0, 0, 0, 12),
             sampling=SAMPLING),
)}


def workload(name: str) -> Workload:
    """A shipped workload by name; an unknown name is a ConfigError naming the valid ones."""
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}{did_you_mean(name, tuple(WORKLOADS))}; "
                          f"valid: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def check_workload_names(where: str, names: Sequence[Any]) -> tuple[str, ...]:
    """`names` validated as a non-empty list of shipped workload names, without repeats."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)) or not names:
        raise ConfigError(f"{where}: workloads must be a non-empty list of names; valid: {', '.join(WORKLOADS)}")
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"{where}: workload names must be strings, got {name!r}")
        workload(name)
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: workloads {list(names)} name one twice")
    return tuple(names)


@dataclass(frozen=True)
class WorkloadPlan:
    """The workloads of one job, resolved (LONG and new_tokens filled in), in case order."""

    workloads: tuple[Workload, ...] = field(default_factory=tuple)

    def to_list(self) -> list[dict[str, Any]]:
        return [w.to_dict() for w in self.workloads]

    @classmethod
    def from_list(cls, items: Sequence[Mapping[str, Any]]) -> WorkloadPlan:
        return cls(tuple(Workload.from_dict(item) for item in items))
