"""The serving loop: greedy generation the way a server schedules it, one mixed forward per engine step.

Per step the loop admits waiting requests (all at once, one at a time, or `join_per_step` per step as
they arrive), gives every decoding sequence one token and the prefilling ones chunks of the rest of a
token budget (chunked prefill), reuses cached KV blocks of a prompt prefix found by block hash (prefix
cache), and preempts the newest sequence when the KV pool (`kv_tokens`) would overflow, recomputing it
(prompt + its tokens so far) when there is room again. Every rank runs the same decisions (they depend
only on token ids and counts), so the ranks stay in lockstep. The same loop with the plain settings
(all at once, whole prompts, no cache, an ample pool) is the schedule twin the route checks compare with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

import torch

from harness.engine.engine import Engine, Generation, length_buckets
from harness.engine.kvcache import PagedKVCache
from harness.engine.model import Batch
from harness.errors import ConfigError
from harness.layout import ROUND_ROBIN, Placement, local_token_count, token_owner
from harness.specs.workload import ALL_AT_ONCE, ONE_AT_A_TIME, SCHEDULES, STAGGERED


@dataclass(frozen=True)
class ServeSettings:
    """How the loop schedules (recorded in the manifest per workload): `schedule` (SCHEDULES) with
    `join_per_step` arrivals per step when staggered; `prefix_cache`; `chunk_tokens` tokens per step in
    all (0: whole prompts); `kv_tokens` tokens the KV pool holds for running sequences (0: the pool's own)."""

    schedule: str = ALL_AT_ONCE
    join_per_step: int = 1
    prefix_cache: bool = False
    chunk_tokens: int = 0
    kv_tokens: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.join_per_step < 1 or self.chunk_tokens < 0 or self.kv_tokens < 0:
            raise ConfigError(f"join_per_step={self.join_per_step} must be >= 1, chunk_tokens="
                              f"{self.chunk_tokens} and kv_tokens={self.kv_tokens} >= 0")

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
    forward and not on its position alone."""

    def __init__(self, cache: PagedKVCache, dcp: int, dcp_rank: int, placement: Placement = ROUND_ROBIN) -> None:
        self.cache = cache
        self.dcp, self.me = dcp, dcp_rank
        self.placement = placement
        self.block = cache.block_size
        self.virtual = cache.block_size * dcp
        self.blocks: dict[str, int] = {}  # chain hash of virtual blocks 0..j -> this rank's local block j

    def _whole(self, n_virtual: int) -> bool:
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
        return self._whole(1)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """This rank's local blocks of the longest cached prefix of `tokens` that leaves at least one
        token to compute."""
        hit: list[int] = []
        for j, key in enumerate(self.keys(tokens, (len(tokens) - 1) // self.virtual)):
            if key not in self.blocks or not self._whole(j + 1):
                break
            hit.append(self.blocks[key])
        return hit

    def owned(self, n_virtual: int) -> list[int]:
        """Positions this rank stores among the first n_virtual virtual blocks, in storage order."""
        return [p for p in range(n_virtual * self.virtual) if token_owner(p, self.dcp, self.placement) == self.me]

    def insert(self, tokens: Sequence[int], seq_blocks: Sequence[int]) -> None:
        """Cache the whole virtual blocks of prompt `tokens`, whose local blocks are `seq_blocks`."""
        for j, key in enumerate(self.keys(tokens, len(tokens) // self.virtual)):
            if not self._whole(j + 1) or j >= len(seq_blocks):
                return
            if key not in self.blocks:
                self.blocks[key] = seq_blocks[j]
                self.cache.pin([seq_blocks[j]])

    def release(self) -> None:
        self.cache.unpin(list(self.blocks.values()))
        self.blocks.clear()


@dataclass(frozen=True)
class Lane:
    """One stream of requests the loop serves: its prompts, their new tokens and its ServeSettings."""

    prompts: Sequence[Sequence[int]]
    new_tokens: Sequence[int]
    settings: ServeSettings = ServeSettings()


class _LaneState:
    """A lane while it runs: waiting and running requests, its KV pool share, its prefix cache, its stats."""

    def __init__(self, lane: Lane, prefix: PrefixCache | None) -> None:
        self.lane, self.settings = lane, lane.settings
        join = self.settings.join_per_step if self.settings.schedule == STAGGERED else 0
        self.waiting = [_Request(i, list(p), arrival=(i // join if join else 0)) for i, p in enumerate(lane.prompts)]
        self.running: list[_Request] = []
        self.prefix = prefix
        self.stats = ServeStats()
        self.tk_ids: list[list[torch.Tensor]] = [[] for _ in lane.prompts]
        self.tk_lp: list[list[torch.Tensor]] = [[] for _ in lane.prompts]

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def room(self, extra: int) -> bool:
        """Whether the running sequences' footprints plus `extra` tokens fit the lane's KV pool."""
        limit = self.settings.kv_tokens
        return not limit or sum(r.footprint for r in self.running) + extra <= limit


class ServingLoop:
    """Greedy generation of one or more lanes of requests on one engine (every rank alike): each engine
    step is one forward over the rows of every lane (decodes, prefill chunks), as a server batches the
    traffic of all its clients; each lane keeps its own schedule, chunk budget, KV pool and prefix cache."""

    def __init__(self, engine: Engine, settings: ServeSettings = ServeSettings()) -> None:
        self.engine = engine
        self.settings = settings  # the lane of generate()
        self.stats = ServeStats()  # generate()'s lane's stats
        comm = engine.decoder.comm
        self.dcp, self.dcp_rank = comm.dcp, comm.dcp_rank

    # -- admission and the pool -------------------------------------------------------------------

    def _admit(self, lane: _LaneState, step: int, width: int) -> None:
        while lane.waiting and width > 0:
            req = lane.waiting[0]
            if req.arrival > step or (lane.settings.schedule == ONE_AT_A_TIME and lane.running):
                return
            if lane.running and not lane.room(req.footprint + 1):
                return
            lane.waiting.pop(0)
            self._open(lane, req)
            lane.running.append(req)
            width -= 1

    def _open(self, lane: _LaneState, req: _Request) -> None:
        cache = self.engine.cache
        req.seq_id = cache.open(1)[0]
        req.pending = req.prompt + req.new
        req.fed, req.rows = 0, 0
        if lane.prefix is None:
            return
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

    def _forward(self, rows: list[tuple[_Request, list[int], list[int]]]) -> torch.Tensor:
        """The step's forward of every row (short and long rows as two batches, engine.length_buckets);
        float32 logits [B, V] at each row's last token."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        for bucket in length_buckets([len(ids) for _, ids, _ in rows]):
            for i, logits in zip(bucket, self._batch_forward([rows[i] for i in bucket])):
                out[i] = logits
        return torch.stack([t for t in out if t is not None])  # [B, V]

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
            lp = torch.log_softmax(logits[[j for j, _ in done_rows]].double(), dim=-1)  # [n, V]
            top = torch.topk(lp, k=min(top_k, lp.shape[-1]), dim=-1)
            for (_, req), ids_row, lp_row in zip(done_rows, top.indices.cpu(), top.values.float().cpu()):
                req.new.append(int(ids_row[0]))
                lane.tk_ids[req.index].append(ids_row)
                lane.tk_lp[req.index].append(lp_row)
        new_tokens = lane.lane.new_tokens
        for req in [r for r in lane.running if len(r.new) >= new_tokens[r.index] and not r.prefilling]:
            lane.running.remove(req)
            self.engine.cache.close([req.seq_id])

    # -- the run ----------------------------------------------------------------------------------

    def run(self, lanes: Sequence[Lane], top_k: int = 5) -> list[tuple[Generation, ServeStats]]:
        """Every lane served together, one forward per engine step; per lane its generation and stats."""
        self.engine.check_lengths([len(p) + n for lane in lanes for p, n in zip(lane.prompts, lane.new_tokens)])
        placement = self.engine.decoder.placement
        # a hit skips the prefix's forward, so every cache group must hold the prefix: a recurrent state
        # (linear attention) keeps only each sequence's latest state, so a hybrid model takes no hits
        cacheable = self.engine.hybrid is None
        states = [_LaneState(lane, PrefixCache(self.engine.cache, self.dcp, self.dcp_rank, placement)
                             if lane.settings.prefix_cache and cacheable else None) for lane in lanes]
        for lane, st in zip(lanes, states):  # what features_on reads: a requested prefix cache that cannot hit
            if lane.settings.prefix_cache:
                st.stats.prefix_cacheable = int(st.prefix is not None and st.prefix.cacheable())
        pins = sum(1 for st in states if st.prefix is not None)
        step = 0
        while any(st.busy for st in states):
            for st in states:
                width = max(1, self.engine.max_batch - pins) - sum(len(o.running) for o in states)
                self._admit(st, step, width)
                self._preempt(st)
            per_lane = [self._rows(st) for st in states]
            rows = [row for lane_rows in per_lane for row in lane_rows]
            if rows:
                logits = self._forward(rows)
                first = 0
                for st, lane_rows in zip(states, per_lane):
                    if lane_rows:
                        st.stats.steps += 1
                        st.stats.max_running = max(st.stats.max_running, len(st.running))
                    self._advance(st, lane_rows, logits[first:first + len(lane_rows)], top_k)
                    first += len(lane_rows)
            step += 1
        k = min(top_k, self.engine.spec.vocab)
        for st in states:
            if st.prefix is not None:
                st.prefix.release()
        return [(_generation(st.tk_ids, st.tk_lp, st.stats.max_running, k), st.stats) for st in states]

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: Sequence[int], top_k: int = 5) -> Generation:
        """Greedy generation of new_tokens[i] tokens for prompts[i] under this loop's settings (one lane)."""
        gen, self.stats = self.run([Lane(prompts, new_tokens, self.settings)], top_k)[0]
        return gen


def _generation(tk_ids: list[list[torch.Tensor]], tk_lp: list[list[torch.Tensor]], width: int, k: int) -> Generation:
    tokens = [[int(t[0]) for t in ids] for ids in tk_ids]
    return Generation(tokens, [torch.stack(t) if t else torch.empty((0, k), dtype=torch.long) for t in tk_ids],
                      [torch.stack(t) if t else torch.empty((0, k)) for t in tk_lp], width)
