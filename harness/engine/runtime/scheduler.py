"""The engine's one generation loop: greedy generation the way a server schedules it, one mixed forward
per engine step. Plain generation (`generate`: a run's generations, GSM8K, `harness serve`), the
workloads' routes and speculative decoding (`speculate`) all step through ServingLoop.

Per step the loop asks each lane which requests nobody waits for any more (`abandoned`: they stop at once
and free their blocks), admits waiting requests (all at once, one at a time, or `join_per_step` per step
as they arrive; at most `max_batch`), gives every decoding sequence one token and the prefilling ones
chunks of the rest of a token budget (chunked prefill), reuses cached KV blocks of a prompt prefix found
by block hash (prefix cache; requests admitted together compute their common prefix once, into the
cache), and preempts the newest sequence when the KV pool (`kv_tokens`) would overflow, recomputing it
(prompt + its tokens so far) when there is room again. A sequence stops after its new tokens, at a stop
token, or when the lane's `stop(index, new_tokens)` says so. A speculative lane's step is one draft +
verify step of its sequences (harness/engine/speculative/decoding.py) instead of one decode row each.
Every rank runs the same decisions (they depend only on token ids and counts, and on hooks that answer
alike on every rank), so the ranks stay in lockstep. The default settings (all at once, whole prompts,
no cache, the pool's slots) are plain batched greedy generation with continuous batching: the schedule
twin the route checks compare with.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Collection, Mapping, Sequence

import torch

from harness.core.errors import ConfigError
from harness.engine.layers.dense import Batch
from harness.engine.runtime.engine import (
    FORWARD_TOKENS,
    Engine,
    Generation,
    PrefixLoader,
    build_batch,
    length_buckets,
    token_groups,
)
from harness.engine.runtime.kvcache import PagedKVCache
from harness.engine.runtime.sampler import Sampler
from harness.engine.speculative.decoding import SeqState, SpecResult, SpeculativeDecoder
from harness.engine.speculative.speculator import Speculator
from harness.partition.layout import ROUND_ROBIN, Placement, local_token_count, token_owner
from harness.specs.sampling import SamplingParams
from harness.specs.workload import ALL_AT_ONCE, ONE_AT_A_TIME, SCHEDULES, STAGGERED

StopCheck = Callable[[int, list[int]], bool]  # (prompt index, its new tokens so far) -> stop now?
Abandoned = Callable[[], Collection[int]]  # asked once per step: prompt indices to drop now


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, leaving each prompt at least one token of its own (its last
    position's logits pick the first new token)."""
    if len(prompts) < 2:
        return 0
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


@dataclass(frozen=True)
class ServeSettings:
    """How the loop schedules (recorded in the manifest per workload): `schedule` (SCHEDULES) with
    `join_per_step` arrivals per step when staggered; `prefix_cache`; `chunk_tokens` tokens per step in
    all (0: whole prompts); `kv_tokens` tokens the KV pool holds for running sequences (0: the pool's own);
    `max_batch` sequences of the lane at once at most (0: as many as the pool's slots hold);
    `split_long`: a step runs the lane's rows in one forward per length bucket (engine.length_buckets:
    prompts past LONG_SEQUENCE tokens apart, decode rows with the short ones), as the workloads' lanes do;
    without it, one forward of its decode rows and one of its prefill rows, padded to the longest;
    `arrivals` the engine step each request arrives at (empty: by `schedule`)."""

    schedule: str = ALL_AT_ONCE
    join_per_step: int = 1
    prefix_cache: bool = False
    chunk_tokens: int = 0
    kv_tokens: int = 0
    max_batch: int = 0
    split_long: bool = False
    arrivals: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "arrivals", tuple(self.arrivals))
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.join_per_step < 1 or self.chunk_tokens < 0 or self.kv_tokens < 0 or self.max_batch < 0:
            raise ConfigError(f"join_per_step={self.join_per_step} must be >= 1, chunk_tokens="
                              f"{self.chunk_tokens}, kv_tokens={self.kv_tokens} and max_batch={self.max_batch} >= 0")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ServeSettings:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class ServeStats:
    """What the loop did: engine steps, most sequences at once, prefix-cache lookups / hits / hit tokens,
    prefill rows (chunks) and prompts that took more than one, preemptions."""

    steps: int = 0
    max_running: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    prefill_chunks: int = 0
    chunked_prompts: int = 0
    preemptions: int = 0
    prefix_cacheable: int = 0  # a lane asking for the prefix cache: 1 when its cache can hold a prompt block

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class _Request:
    index: int
    prompt: list[int]
    arrival: int
    new: list[int] = field(default_factory=list)
    seq_id: int | None = None
    pending: list[int] = field(default_factory=list)  # what the prefill feeds: the prompt (+ new on recompute)
    fed: int = 0                                      # tokens of `pending` in the cache
    shift: int = 0                                    # position offset of new tokens (preempt-resume-position)
    rows: int = 0                                     # prefill rows so far
    spec: SeqState | None = None                      # a speculative lane's sequence (both caches)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.pending)

    def position(self, i: int) -> int:
        """Position of token i of prompt + new."""
        return i + (self.shift if i >= len(self.prompt) else 0)

    @property
    def footprint(self) -> int:
        """Tokens the sequence holds in the KV pool once its prefill is done."""
        return len(self.prompt) + len(self.new)


class PrefixCache:
    """One rank's cached prompt blocks, keyed by a chain hash of virtual blocks: block_size x dcp global
    tokens, of which every DCP rank stores exactly block_size (one whole local block), so a hit attaches
    each rank's own blocks with the positions it owns (DCP token ownership kept; GCD-duplicated KV heads
    are part of every local block). A virtual block whose tokens do not fill whole local blocks on every
    rank under the engine's token placement (an interleave size past block_size) is never cached, nor is
    any block under the contiguous placement, where a token's owner depends on its sequence's first
    forward and not on its position alone. It holds at most one pool slot's blocks (the slot the loop
    keeps free for it); blocks past that are not cached."""

    def __init__(self, cache: PagedKVCache, dcp: int, dcp_rank: int, placement: Placement = ROUND_ROBIN) -> None:
        self.cache = cache
        self.dcp, self.me = dcp, dcp_rank
        self.placement = placement
        self.block = cache.block_size
        self.virtual = cache.block_size * dcp
        self.blocks: dict[str, int] = {}  # chain hash of virtual blocks 0..j -> this rank's local block j
        self.limit = cache.capacity.blocks_per_slot

    def whole(self, n_virtual: int) -> bool:
        """Whether the first n_virtual virtual blocks fill whole local blocks on every DCP rank."""
        span = n_virtual * self.virtual
        if self.placement.kind == "contiguous" and self.dcp > 1:
            return False
        return all(local_token_count(span, r, self.dcp, self.placement) == n_virtual * self.block
                   for r in range(self.dcp))

    def keys(self, tokens: Sequence[int], n: int) -> list[str]:
        out, digest = [], hashlib.sha256()
        for j in range(n):
            digest.update(repr(tuple(tokens[j * self.virtual:(j + 1) * self.virtual])).encode())
            out.append(digest.copy().hexdigest())
        return out

    def cacheable(self) -> bool:
        """Whether this cache can hold a prompt's first virtual block at all under the token placement."""
        return self.whole(1)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """This rank's local blocks of the longest cached prefix of `tokens` that leaves at least one
        token to compute."""
        hit: list[int] = []
        for j, key in enumerate(self.keys(tokens, (len(tokens) - 1) // self.virtual)):
            if key not in self.blocks or not self.whole(j + 1):
                break
            hit.append(self.blocks[key])
        return hit

    def owned(self, n_virtual: int) -> list[int]:
        """Positions this rank stores among the first n_virtual virtual blocks, in storage order."""
        return [p for p in range(n_virtual * self.virtual) if token_owner(p, self.dcp, self.placement) == self.me]

    def insert(self, tokens: Sequence[int], seq_blocks: Sequence[int]) -> None:
        """Cache the whole virtual blocks of prompt `tokens`, whose local blocks are `seq_blocks`."""
        for j, key in enumerate(self.keys(tokens, len(tokens) // self.virtual)):
            if not self.whole(j + 1) or j >= len(seq_blocks):
                return
            if key not in self.blocks and len(self.blocks) < self.limit:
                self.blocks[key] = seq_blocks[j]
                self.cache.pin([seq_blocks[j]])

    def release(self) -> None:
        self.cache.unpin(list(self.blocks.values()))
        self.blocks.clear()


@dataclass(frozen=True)
class Lane:
    """One stream of requests the loop serves: its prompts, their new tokens (at most), its ServeSettings,
    its stop tokens and stop check, the hook naming abandoned requests (asked once per engine step; it
    must answer alike on every rank), and for a speculative lane its SpeculativeDecoder (whole prompts,
    no prefix cache, no KV-pool limit, no stop check: a step commits several tokens at once)."""

    prompts: Sequence[Sequence[int]]
    new_tokens: Sequence[int]
    settings: ServeSettings = ServeSettings()
    stop_token_ids: frozenset[int] = frozenset()
    stop: StopCheck | None = None
    abandoned: Abandoned | None = None
    speculative: SpeculativeDecoder | None = None
    loader: PrefixLoader | None = None  # a disaggregated run's KV source of each prompt but its last token
    sampler: Sampler | None = None  # a sampled lane: each request draws from its own generator, seeds[i]
    seeds: Sequence[int] = ()

    def __post_init__(self) -> None:
        s = self.settings
        if self.sampler is not None and (self.speculative is not None or len(self.seeds) != len(self.prompts)):
            raise ConfigError(f"a sampled lane needs one seed per prompt ({len(self.prompts)}, got {len(self.seeds)}) "
                              "and no speculator")
        if self.speculative is not None and (s.prefix_cache or s.chunk_tokens or s.kv_tokens or self.stop):
            raise ConfigError(f"a speculative lane prefills whole prompts without a prefix cache, KV-pool limit "
                              f"or stop check; got {s} with stop={self.stop!r}")

    def finished(self, index: int, new: list[int]) -> bool:
        """Whether prompt `index` stops after its new tokens `new` (its last one just committed)."""
        return (len(new) >= self.new_tokens[index] or new[-1] in self.stop_token_ids
                or (self.stop is not None and self.stop(index, new)))


class _LaneState:
    """A lane while it runs: waiting and running requests, its KV pool share, its prefix cache, its stats."""

    def __init__(self, lane: Lane, prefix: PrefixCache | None) -> None:
        self.lane, self.settings = lane, lane.settings
        join = self.settings.join_per_step if self.settings.schedule == STAGGERED else 0
        arrivals = self.settings.arrivals or [i // join if join else 0 for i in range(len(lane.prompts))]
        self.waiting = [_Request(i, list(p), arrival=a) for i, (p, a) in enumerate(zip(lane.prompts, arrivals))]
        self.requests = list(self.waiting)  # every request, in prompt order
        self.running: list[_Request] = []
        self.prefix = prefix
        self.stats = ServeStats()
        self.width = 0  # the most sequences the lane could run at once (max_batch as the pool allows it)
        self.tk_ids: list[list[torch.Tensor]] = [[] for _ in lane.prompts]
        self.tk_lp: list[list[torch.Tensor]] = [[] for _ in lane.prompts]
        sampler = lane.sampler
        self.generators = [sampler.generator(seed) for seed in lane.seeds] if sampler is not None else []
        self.uniforms: list[list[float]] = [[] for _ in lane.prompts]  # a sampled lane: each step's uniform

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def room(self, extra: int) -> bool:
        """Whether the running sequences' footprints plus `extra` tokens fit the lane's KV pool."""
        limit = self.settings.kv_tokens
        return not limit or sum(r.footprint for r in self.running) + extra <= limit


class ServingLoop:
    """Greedy generation of one or more lanes of requests on one engine (every rank alike): each engine
    step is one forward over the rows of every plain lane (decodes, prefill chunks), as a server batches
    the traffic of all its clients, and one draft + verify step of every speculative lane; each lane keeps
    its own schedule, chunk budget, KV pool and prefix cache."""

    def __init__(self, engine: Engine, settings: ServeSettings = ServeSettings()) -> None:
        self.engine = engine
        self.settings = settings  # the lane of generate()
        self.stats = ServeStats()  # generate()'s lane's stats
        comm = engine.decoder.comm
        self.dcp, self.dcp_rank = comm.dcp, comm.dcp_rank

    # -- admission and the pool -------------------------------------------------------------------

    def _drop(self, lane: _LaneState) -> None:
        """Stop the requests the lane's `abandoned` hook names, waiting or running, and free their blocks."""
        if lane.lane.abandoned is None:
            return
        gone = set(lane.lane.abandoned())
        if not gone:
            return
        lane.waiting = [r for r in lane.waiting if r.index not in gone]
        for req in [r for r in lane.running if r.index in gone]:
            lane.running.remove(req)
            self._close(lane, req)

    def _close(self, lane: _LaneState, req: _Request) -> None:
        decoder = lane.lane.speculative
        if decoder is not None and req.spec is not None:
            decoder.close([req.spec])
        elif req.seq_id is not None:
            self.engine.cache.close([req.seq_id])

    def _admit(self, lane: _LaneState, step: int, width: int) -> list[_Request]:
        """Move arrived requests that fit from waiting to running (not opened yet); returns them."""
        admitted: list[_Request] = []
        while lane.waiting and width > 0:
            req = lane.waiting[0]
            if req.arrival > step or (lane.settings.schedule == ONE_AT_A_TIME and lane.running):
                break
            if lane.running and not lane.room(req.footprint + 1):
                break
            lane.waiting.pop(0)
            lane.running.append(req)
            admitted.append(req)
            width -= 1
        return admitted

    def _warm(self, lane: _LaneState, group: list[_Request]) -> None:
        """Requests admitted together compute their common prefix once: its whole virtual blocks (when
        the prefix cache does not hold them yet) are prefilled as a sequence of their own and cached."""
        if lane.prefix is None or len(group) < 2:
            return
        tokens = group[0].prompt + group[0].new
        n = shared_prefix_length([r.prompt + r.new for r in group]) // lane.prefix.virtual
        if n == 0 or not lane.prefix.whole(n) or len(lane.prefix.lookup(tokens[:n * lane.prefix.virtual + 1])) >= n:
            return
        cache = self.engine.cache
        seq = cache.open(1)
        span = tokens[:n * lane.prefix.virtual]
        self.engine.decoder.hidden(build_batch(seq, [span], [0], self.engine.state.device))
        lane.prefix.insert(span, cache.seqs[seq[0]].blocks)
        cache.close(seq)

    def _open(self, lane: _LaneState, req: _Request) -> None:
        cache = self.engine.cache
        req.seq_id = cache.open(1)[0]
        req.pending = req.prompt + req.new
        req.fed, req.rows = 0, 0
        if lane.prefix is not None:
            self._lookup(lane, req)
        # the prompt's KV from the prefill side, all but its last token (its logits), unless the prefix cache
        # served a prefix (a decode-side hit: the rest of the prompt is computed here)
        if lane.lane.loader is not None and not req.new and req.fed == 0:
            req.fed = lane.lane.loader(req.seq_id, req.index, req.prompt[:-1])

    def _lookup(self, lane: _LaneState, req: _Request) -> None:
        """Share the cached blocks of the longest cached prefix of the request's tokens (a prefix hit)."""
        assert lane.prefix is not None
        cache = self.engine.cache
        lane.stats.prefix_lookups += 1
        # the prefix-cache-never-hits fault: the lookup finds nothing (the route silently off)
        blocks = [] if self.engine.flags.prefix_never_hits else lane.prefix.lookup(req.pending)
        if blocks:
            cache.share(req.seq_id, blocks, lane.prefix.owned(len(blocks)))
            hit = len(blocks) * lane.prefix.virtual
            # the dcp-prefix-hit-length fault: the hit measured in local blocks (block_size tokens each)
            req.fed = len(blocks) * lane.prefix.block if self.engine.flags.prefix_hit_local else hit
            lane.stats.prefix_hits += 1
            lane.stats.prefix_hit_tokens += hit

    def _preempt(self, lane: _LaneState) -> None:
        """Preempt the newest sequences (recompute later) until this step's decoded tokens fit the lane's pool."""
        growth = sum(1 for r in lane.running if not r.prefilling)
        while len(lane.running) > 1 and not lane.room(growth):
            victim = lane.running.pop()
            growth -= 0 if victim.prefilling else 1
            self.engine.cache.close([victim.seq_id])
            victim.seq_id = None
            victim.shift = self.engine.flags.resume_gap  # the preempt-resume-position fault
            lane.waiting.insert(0, victim)
            lane.stats.preemptions += 1

    # -- one step ---------------------------------------------------------------------------------

    def _rows(self, lane: _LaneState) -> list[tuple[_Request, list[int], list[int]]]:
        """(request, token ids, positions) fed this step: decodes first, then prefill chunks in the budget."""
        budget = lane.settings.chunk_tokens or None
        rows: list[tuple[_Request, list[int], list[int]]] = []
        for req in lane.running:
            if not req.prefilling:
                i = len(req.prompt) + len(req.new) - 1
                rows.append((req, [req.new[-1]], [req.position(i)]))
        left = None if budget is None else max(0, budget - len(rows))
        for req in lane.running:
            if not req.prefilling or left == 0:
                continue
            n = len(req.pending) - req.fed if left is None else min(left, len(req.pending) - req.fed)
            span = range(req.fed, req.fed + n)
            positions = [req.position(i) for i in span]
            if self.engine.flags.chunk_restart and req.fed > 0 and self.dcp_rank > 0:
                positions = list(range(n))  # the dcp-chunk-restart fault: a later chunk restarts at 0 here
            rows.append((req, req.pending[req.fed:req.fed + n], positions))
            left = None if left is None else left - n
        return rows

    def _forward(self, rows: list[tuple[_Request, list[int], list[int]]], split: list[bool]) -> torch.Tensor:
        """The step's forward of every row: rows of split_long lanes by length bucket (engine.length_buckets),
        the others' decode rows and prefill rows as two batches, each in forwards of at most FORWARD_TOKENS padded
        tokens (token_groups); float32 logits [B, V] at each row's last token."""
        batches: dict[tuple[str, int], list[int]] = {}
        for b, bucket in enumerate(length_buckets([len(ids) for _, ids, _ in rows])):
            for i in bucket:
                key = ("length", b) if split[i] else ("kind", int(rows[i][0].prefilling))
                batches.setdefault(key, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(rows)
        lengths = [len(ids) for _, ids, _ in rows]
        groups = (self._invariant_groups(rows) if self.engine.batch_invariant else
                  [g for batch in batches.values() for g in token_groups(batch, lengths, FORWARD_TOKENS)])
        for group in groups:
            for i, logits in zip(group, self._batch_forward([rows[i] for i in group])):
                out[i] = logits
        return torch.stack([t for t in out if t is not None])  # [B, V]

    def _invariant_groups(self, rows: list[tuple[_Request, list[int], list[int]]]) -> list[list[int]]:
        """The batch-invariant mode's forwards: every row alone, so each request's arithmetic (shapes, reduction
        orders, collective buffers) is the same whatever else the step runs; under the batched-decode fault the
        decode rows still share one forward (the mode's promise broken where batches are most common)."""
        if not self.engine.flags.batched_decode:
            return [[i] for i in range(len(rows))]
        decode = [i for i, (req, ids, _) in enumerate(rows) if not req.prefilling and len(ids) == 1]
        return ([decode] if decode else []) + [[i] for i in range(len(rows)) if i not in decode]

    def _batch_forward(self, rows: list[tuple[_Request, list[int], list[int]]]) -> torch.Tensor:
        """One forward of `rows`; float32 logits [B, V] at each row's last token."""
        dev = self.engine.state.device
        width = max(len(ids) for _, ids, _ in rows)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for _, ids, _ in rows], dtype=torch.long)  # [B, S]
        positions = torch.tensor([pos + [pos[-1] + 1 + k for k in range(width - len(pos))] for _, _, pos in rows],
                                 dtype=torch.long)  # [B, S]; padding continues the row's positions
        lengths = torch.tensor([len(t) for _, t, _ in rows])  # [B]
        valid = torch.arange(width)[None, :] < lengths[:, None]  # [B, S]
        batch = Batch(tuple(int(r.seq_id or 0) for r, _, _ in rows), ids.to(dev), positions.to(dev), valid.to(dev))
        hidden = self.engine.decoder.hidden(batch)  # [B, S, H]
        last = (lengths - 1).to(hidden.device)
        picked = hidden[torch.arange(len(rows), device=hidden.device), last]  # [B, H]
        return self.engine.decoder.logits(picked[:, None])[:, 0].float()  # [B, V]

    def _advance(self, lane: _LaneState, rows: list[tuple[_Request, list[int], list[int]]], logits: torch.Tensor,
                 top_k: int) -> None:
        """Book one step's rows of `lane` (their logits [n, V]): prefill progress, new tokens, finished sequences."""
        done_rows = []
        for j, (req, ids, _) in enumerate(rows):
            if req.prefilling:
                req.fed += len(ids)
                req.rows += 1
                lane.stats.prefill_chunks += 1
                lane.stats.chunked_prompts += req.rows == 2
                if req.prefilling:
                    continue
                if lane.prefix is not None and req.seq_id is not None:
                    lane.prefix.insert(req.prompt, self.engine.cache.seqs[req.seq_id].blocks)
            done_rows.append((j, req))
        if done_rows:
            picked = logits[[j for j, _ in done_rows]]  # [n, V]
            lp = torch.log_softmax(picked.double(), dim=-1)  # [n, V]
            top = torch.topk(lp, k=min(top_k, lp.shape[-1]), dim=-1)
            chosen = top.indices[:, 0]  # [n]: greedy
            sampler = lane.lane.sampler
            if sampler is not None:  # after the vocab gather: every rank draws alike from the request's generator
                reqs = [req for _, req in done_rows]
                u = sampler.uniforms([lane.generators[r.index] for r in reqs])  # [n, 1]
                chosen = sampler.pick(sampler.probabilities(picked, [r.prompt for r in reqs], [r.new for r in reqs]),
                                      u)[:, 0]
                for r, value in zip(reqs, u[:, 0].tolist()):
                    lane.uniforms[r.index].append(value)
            for (_, req), token, ids_row, lp_row in zip(done_rows, chosen.tolist(), top.indices.cpu(),
                                                        top.values.float().cpu()):
                req.new.append(int(token))
                lane.tk_ids[req.index].append(ids_row)
                lane.tk_lp[req.index].append(lp_row)
        for req in [r for r in lane.running if not r.prefilling and lane.lane.finished(r.index, r.new)]:
            lane.running.remove(req)
            self.engine.cache.close([req.seq_id])

    def _speculate(self, lane: _LaneState, decoder: SpeculativeDecoder, admitted: list[_Request]) -> None:
        """A speculative lane's engine step: one draft + verify step of its running sequences, then the
        prefill of the admitted ones (each commits its first token); finished sequences are closed."""
        stepping = [r for r in lane.running if r.spec is not None]
        if stepping:
            decoder.step([r.spec for r in stepping if r.spec is not None])
        if admitted:
            loader = lane.lane.loader
            load = (None if loader is None else  # a disaggregated run: each prompt's KV but its last token's
                    lambda b, seq_id: loader(seq_id, admitted[b].index, admitted[b].prompt[:-1]))
            for req, seq in zip(admitted, decoder.start([r.prompt for r in admitted], load)):
                req.spec, req.seq_id = seq, seq.target_id
        if stepping or admitted:
            lane.stats.steps += 1
            lane.stats.max_running = max(lane.stats.max_running, len(lane.running))
        stop = lane.lane.stop_token_ids
        for req in [r for r in lane.running if r.spec is not None]:
            new = req.spec.generated
            if len(new) >= lane.lane.new_tokens[req.index] or any(t in stop for t in new):
                lane.running.remove(req)
                decoder.close([req.spec])

    # -- the run ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, lanes: Sequence[Lane], top_k: int = 5) -> list[tuple[Generation, ServeStats]]:
        """Every lane served together, one forward per engine step (and one draft + verify step per
        speculative lane); per lane its generation and stats."""
        for lane in lanes:
            if lane.speculative is not None:
                _check_speculative(self.engine, lane)
        self.engine.check_lengths([len(p) + n for lane in lanes for p, n in zip(lane.prompts, lane.new_tokens)])
        placement = self.engine.decoder.placement
        # a hit skips the prefix's forward, so every cache group must hold the prefix: a recurrent state
        # (linear attention) keeps only each sequence's latest state, so a hybrid model takes no hits
        cacheable = self.engine.model.prefix_cacheable
        states = [_LaneState(lane, PrefixCache(self.engine.cache, self.dcp, self.dcp_rank, placement)
                             if lane.settings.prefix_cache and cacheable else None) for lane in lanes]
        for lane, st in zip(lanes, states):  # what features_on reads: a requested prefix cache that cannot hit
            if lane.settings.prefix_cache:
                st.stats.prefix_cacheable = int(st.prefix is not None and st.prefix.cacheable())
        pins = sum(1 for st in states if st.prefix is not None)
        slots = max(1, self.engine.max_batch - pins)
        for st in states:
            st.width = max(1, min(slots, st.settings.max_batch or slots))
        step = 0
        while any(st.busy for st in states):
            admitted: list[list[_Request]] = []
            for st in states:
                self._drop(st)
                width = min(slots - sum(len(o.running) for o in states), st.width - len(st.running))
                admitted.append(self._admit(st, step, width))
                if st.lane.speculative is None:
                    self._warm(st, admitted[-1])
                    for req in admitted[-1]:
                        self._open(st, req)
                    self._preempt(st)
            per_lane = [self._rows(st) if st.lane.speculative is None else [] for st in states]
            rows = [row for lane_rows in per_lane for row in lane_rows]
            split = [st.settings.split_long for st, lane_rows in zip(states, per_lane) for _ in lane_rows]
            if rows:
                logits = self._forward(rows, split)
                first = 0
                for st, lane_rows in zip(states, per_lane):
                    if lane_rows:
                        st.stats.steps += 1
                        st.stats.max_running = max(st.stats.max_running, len(st.running))
                    self._advance(st, lane_rows, logits[first:first + len(lane_rows)], top_k)
                    first += len(lane_rows)
            for st, new in zip(states, admitted):
                if st.lane.speculative is not None:
                    self._speculate(st, st.lane.speculative, new)
            step += 1
        k = min(top_k, self.engine.spec.vocab)
        for st in states:
            if st.prefix is not None:
                st.prefix.release()
        return [(_generation(st, k), st.stats) for st in states]

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: Sequence[int], top_k: int = 5) -> Generation:
        """Greedy generation of new_tokens[i] tokens for prompts[i] under this loop's settings (one lane)."""
        gen, self.stats = self.run([Lane(prompts, new_tokens, self.settings)], top_k)[0]
        return gen


def _check_speculative(engine: Engine, lane: Lane) -> None:
    """A verify step may store k + 1 tokens past the last committed one: the pool's slots must hold them."""
    k = lane.speculative.k if lane.speculative is not None else 0
    limit = max((len(p) + n for p, n in zip(lane.prompts, lane.new_tokens)), default=0) + k + 1
    if lane.prompts and limit > engine.pool.max_seq_len:
        raise ConfigError(f"speculative decoding needs max_seq_len >= {limit} (longest prompt + "
                          f"max_new_tokens + k + 1), the KV pool has {engine.pool.max_seq_len}")


def _trim(new: list[int], max_new: int, stop: frozenset[int]) -> list[int]:
    """A speculative sequence's committed tokens cut at max_new and after its first stop token."""
    new = new[:max_new]
    for i, t in enumerate(new):
        if t in stop:
            return new[:i + 1]
    return new


def _generation(st: _LaneState, k: int) -> Generation:
    if st.lane.speculative is None:
        tokens = [list(r.new) for r in st.requests]  # greedy: each step's top-1; a sampled lane: its draws
        return Generation(tokens, [torch.stack(t) if t else torch.empty((0, k), dtype=torch.long) for t in st.tk_ids],
                          [torch.stack(t) if t else torch.empty((0, k)) for t in st.tk_lp], st.width,
                          uniforms=st.uniforms if st.lane.sampler is not None else [])
    seqs = [r.spec for r in st.requests]
    tokens = [_trim(s.generated, n, st.lane.stop_token_ids) if s is not None else []
              for s, n in zip(seqs, st.lane.new_tokens)]
    empty = [torch.empty((0, 0), dtype=torch.long) for _ in seqs]
    return Generation(tokens, empty, [t.float() for t in empty], st.width,
                      accepted=[list(s.accepted) if s is not None else [] for s in seqs],
                      drafts=[[list(d) for d in s.drafts] if s is not None else [] for s in seqs])


# -- the loop's entry points ------------------------------------------------------------------------------


def sampler_for(engine: Engine, params: SamplingParams) -> Sampler:
    """The engine's sampler for `params` on this rank (its vocab shards, TP rank and the fault's sampler slip)."""
    state = engine.state
    return Sampler.of(params, engine.spec.vocab, state.tp, state.rank, engine.flags.sampler_slip)


def generate(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_k: int = 5,
             stop_token_ids: frozenset[int] = frozenset(), stop: StopCheck | None = None,
             abandoned: Abandoned | None = None, settings: ServeSettings = ServeSettings(),
             loader: PrefixLoader | None = None, sampler: Sampler | None = None,
             seeds: Sequence[int] = ()) -> Generation:
    """Greedy generation of every prompt on `engine` (every rank alike): the serving loop with one lane,
    by default all at once with continuous batching (a finished sequence's slot goes to the next prompt),
    whole prompts, no prefix cache. A sequence stops at a stop token, when stop(index, new_tokens) says
    so (it must answer alike on every rank), or after max_new_tokens; `abandoned()` names prompts nobody
    waits for any more (they stop at once with the tokens they have). A `loader` (the decode side of a
    disaggregated run) places each prompt's KV but its last token's when the request is admitted. With a `sampler`
    each prompt samples instead, from its own generator seeded seeds[i]."""
    lane = Lane(prompts, [max_new_tokens] * len(prompts), settings, stop_token_ids, stop, abandoned, loader=loader,
                sampler=sampler, seeds=seeds)
    return ServingLoop(engine).run([lane], top_k)[0][0]


def speculate(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              stop_token_ids: frozenset[int] = frozenset(), abandoned: Abandoned | None = None,
              loader: PrefixLoader | None = None) -> SpecResult:
    """Greedy speculative generation of every prompt: the serving loop with one speculative lane
    (`loader`: a disaggregated run's KV source of each prompt)."""
    t0 = time.time()
    lane = Lane(prompts, [max_new_tokens] * len(prompts), stop_token_ids=stop_token_ids, abandoned=abandoned,
                speculative=decoder, loader=loader)
    gen = ServingLoop(decoder.target).run([lane])[0][0]
    return SpecResult(kind=decoder.spec.kind, k=decoder.k, tokens=gen.tokens, accepted=gen.accepted,
                      wall_s=time.time() - t0, drafts=gen.drafts)


def run_speculative_cases(target: Engine, speculator: Speculator, prompts: Sequence[Sequence[int]], k: int,
                          max_new_tokens: int, stop_token_ids: frozenset[int] = frozenset(),
                          loader: PrefixLoader | None = None) -> SpecResult:
    """What a -draft / -mtp run's worker calls (every rank, in lockstep): greedy speculative generation of
    each prompt with `speculator`, k draft tokens per step, on the same topology as `target`."""
    return speculate(SpeculativeDecoder(target, speculator, k), prompts, max_new_tokens, stop_token_ids,
                     loader=loader)
