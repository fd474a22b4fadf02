"""The decode side of a disaggregated run: a KV connector that loads each request's prompt KV from the
store asynchronously and places it in this rank's paged cache by the transfer plan (pd_layout.py).

State machine of one load (one request on one route: the teacher-forced decode path or generation):
    waiting  -> loading   the request is admitted: its destination blocks are reserved (held while loading)
    loading  -> loaded    every rank read and assembled its rows, the rows are written into the blocks
    loading  -> loading   an attempt failed on some rank: retried, at most LoadPolicy.max_attempts in all,
                          never past the request's deadline (LoadPolicy.deadline_s from admission)
    loading  -> failed    attempts or deadline used up: the blocks return to the pool, and by the policy the
                          request is recomputed from position 0 (`recompute`) or fails the run naming it (`fail`)
Reads run on a thread pool from prefetch() on, so loads overlap the decode world's other work; every rank
takes the same decisions (each attempt's outcome is agreed over the world), so the ranks stay in lockstep.
What a load did is kept (LoadRecord) with the digests of the rows each rank holds after placement, for the
pd checks. The pd-* faults change the placement or the failure path the way the engine bugs they are
named after do (harness/engine/faults.py).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from harness.core.errors import RunError
from harness.engine.pd.state import assemble, capture, place, state_digests, state_keys
from harness.engine.pd.store import read_entry, sequence_digests
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.statecache import HybridCache
from harness.partition.layout import Placement, token_owner
from harness.partition.pd_layout import HeadSource, PDPlan, naive_head_sources
from harness.partition.pd_state import PDStatePlan, StateMove, same_rank_moves

WAITING, LOADING, LOADED, FAILED = "waiting", "loading", "loaded", "failed"
HANG_GRACE_S = 30.0  # a load still running this long past its deadline is a hang: stacks dumped, the rank exits
HANG_EXIT = 75
POLICIES: tuple[str, ...] = ("recompute", "fail")


@dataclass(frozen=True)
class LoadPolicy:
    """How failed loads end: `max_attempts` reads in all, none past `deadline_s` after admission, then
    `on_failure` (recompute the prompt from position 0, or fail naming the request)."""

    max_attempts: int = 3
    deadline_s: float = 10.0
    backoff_s: float = 0.05
    on_failure: str = "recompute"

    def to_dict(self) -> dict[str, Any]:
        return {"max_attempts": self.max_attempts, "deadline_s": self.deadline_s, "backoff_s": self.backoff_s,
                "on_failure": self.on_failure}


@dataclass
class LoadRecord:
    """One load: its route and request, tokens asked for, final state, each attempt's outcome ('ok' or the
    error), what followed ('loaded', 'recomputed', 'failed'), where a recompute resumed, blocks held while
    loading, seconds waited."""

    route: str
    request: int
    tokens: int
    state: str = WAITING
    attempts: list[str] = field(default_factory=list)
    outcome: str = ""
    resume_offset: int = 0
    blocks_held: int = 0
    waited_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"route": self.route, "request": self.request, "tokens": self.tokens, "state": self.state,
                "attempts": self.attempts, "outcome": self.outcome, "resume_offset": self.resume_offset,
                "blocks_held": self.blocks_held, "waited_s": round(self.waited_s, 4)}


@dataclass(frozen=True)
class _Loaded:
    """A request's rows for this rank: its prompt ids, the positions it stores (storage order) and per
    layer K (and V) [n, kv_local, d]."""

    tokens: list[int]
    positions: list[int]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    state: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # n -> (conv, recurrent)


class KVConnector:
    """One decode rank's connector (every rank of the decode world has one; they act in lockstep)."""

    def __init__(self, engine: Engine, plan: PDPlan, store: Path, policy: LoadPolicy = LoadPolicy(),
                 state: PDStatePlan | None = None) -> None:
        self.engine, self.plan, self.store, self.policy = engine, plan, store, policy
        cache = engine.cache
        # a model with linear-attention state: its transfer plan (pd_state.py) and this rank's state cache
        self.state_plan, self.state_cache = (state, cache) if state is not None and isinstance(cache, HybridCache) \
            else (None, None)
        self.rank = engine.state.rank
        self.flags = engine.flags
        self.heads = self._heads()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-load")
        self._futures: dict[int, Future[_Loaded]] = {}
        self._reads: dict[int, int] = {}
        self.records: list[LoadRecord] = []
        # "{route}.{request}" -> (digests [layers, kv_local, stored], positions [stored]) right after placement
        self.held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.held_state: dict[str, torch.Tensor] = {}  # "{route}.{request}" -> state digests [Ll, slices] placed
        self.free_start = engine.cache.free_blocks
        self._lock = threading.Lock()  # guards the records (the readers' threads and the loop report into them)

    def _heads(self) -> tuple[HeadSource, ...]:
        mine = self.plan.ranks[self.rank]
        if self.flags.pd_naive_gqa:  # the fault: prefill rank h taken as the holder of KV head h
            return naive_head_sources(self.plan, self.rank)
        return mine.heads

    def owned(self, tokens: int) -> list[int]:
        """Positions 0..tokens-1 this rank keeps, in storage order (the pd-block-owner fault: whole blocks
        dealt to the DCP ranks in turn)."""
        if self.flags.pd_block_owner:
            dcp = self.plan.decode.dcp
            me = self.plan.decode.ranks[self.rank].dcp_rank
            whole = Placement("interleave", self.engine.cache.block_size)
            return [t for t in range(tokens) if token_owner(t, dcp, whole) == me]
        return self.plan.owned_positions(self.rank, tokens)

    # -- reading (thread pool) ---------------------------------------------------------------------

    def prefetch(self, requests: Iterable[int]) -> None:
        """Start reading every request's entry now (waiting -> loading happens at admission)."""
        for index in requests:
            self._submit(index)

    def _submit(self, index: int) -> None:
        self._reads[index] = self._reads.get(index, 0) + 1
        self._futures[index] = self._pool.submit(self._read, index, self._reads[index])

    def _read(self, index: int, attempt: int) -> _Loaded:
        """Read the entries of the prefill ranks this rank's heads come from and assemble its rows."""
        if self.flags.pd_flaky_reads and attempt == 1:
            raise OSError(f"transient read error of request {index} (first attempt)")
        if self.flags.pd_never_reads:  # the fault: the entry looked up under another key, on an undamaged store
            raise FileNotFoundError(f"no store entry for request {index} under the decode side's key")
        ranks = {s for h in self.heads for s in h.sources}
        if self.state_plan is not None:
            ranks |= {m.src_rank for m in self._state_moves()}
        entries = {r: read_entry(self.store, index, r) for r in sorted(ranks)}
        first = next(iter(entries.values()))
        tokens = first["tokens"].tolist()
        owned = self.owned(len(tokens))
        layers = len(self.engine.cache.k)
        n_kv = len(self.heads)
        # per head: its destination slot and, per source rank, (destination rows, source rows, source slot)
        moves = []
        for head in self.heads:
            by_src: dict[int, tuple[list[int], list[int]]] = {}
            for j, (src, row) in enumerate(self.plan.source_rows(head, owned, len(tokens))):
                by_src.setdefault(src, ([], []))[0].append(j)
                by_src[src][1].append(row)
            # the pd-head-offset fault: the destination slot taken from the source's slice index
            dest = head.src_slots[0] if self.flags.pd_head_offset else head.dest_slot
            moves.append((dest, [(src, torch.tensor(js), torch.tensor(rows), head.src_slots[head.sources.index(src)])
                                 for src, (js, rows) in by_src.items()]))
        k_out, v_out = [], []
        for layer in range(layers):
            sample = first[f"k.{layer}"]
            k = sample.new_zeros((len(owned), n_kv, sample.shape[-1]))  # [n, kv_local, d]
            v = k.clone() if f"v.{layer}" in first else None
            for dest, parts in moves:
                for src, js, rows, slot in parts:
                    k[js, dest] = entries[src][f"k.{layer}"][rows, slot]  # [m, d] rows of one head
                    if v is not None:
                        v[js, dest] = entries[src][f"v.{layer}"][rows, slot]
            k_out.append(k)
            if v is not None:
                v_out.append(v)
        return _Loaded(tokens, owned, k_out, v_out, self._assemble_state(entries))

    def _state_moves(self) -> tuple[StateMove, ...]:
        """Where this rank's state slices are read (the pd-state-same-rank fault: from the prefill rank of this
        rank's number, as if both sides split the state alike)."""
        assert self.state_plan is not None
        if self.flags.pd_state_same_rank:
            return same_rank_moves(self.state_plan, self.rank)
        return self.state_plan.moves[self.rank]

    def _assemble_state(self, entries: dict[int, dict[str, torch.Tensor]]
                        ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's linear-attention state at every cut the entries hold, assembled by the state plan."""
        if self.state_plan is None or self.state_cache is None:
            return {}
        plan, cache = self.state_plan, self.state_cache
        moves = self._state_moves()
        cuts = [int(k.rsplit(".", 1)[1]) for k in entries[moves[0].src_rank] if k.startswith("state.conv.")]
        out = {}
        for n in cuts:
            conv_key, rec_key, _ = state_keys(n)
            if not all(conv_key in entries[m.src_rank] for m in moves):
                continue
            conv, rec = assemble({r: (e[conv_key], e[rec_key]) for r, e in entries.items() if conv_key in e},
                                 plan.prefill, plan.decode[self.rank], moves, cache.conv[0], cache.recurrent[0])
            if self.flags.pd_state_conv_shift:  # the fault: the conv window one token late (newest input lost)
                conv[..., 1:] = conv[..., :-1].clone()
                conv[..., 0] = 0
            out[n] = (conv, rec)
        return out

    # -- placing (every rank, in lockstep) ---------------------------------------------------------

    def load(self, seq_id: int, index: int, tokens: list[int], route: str) -> int:
        """Place the KV of `tokens` (a prefix of request `index`'s prompt) into empty sequence `seq_id`;
        returns how many leading tokens are in the cache now (0: the request computes its prompt)."""
        n = len(tokens)
        if n == 0:
            return 0
        cache = self.engine.cache
        rec = LoadRecord(route, index, n, state=LOADING)
        self.records.append(rec)
        owned = [t for t in self.owned(n) if t < n]
        slots = cache.reserve(seq_id, owned)  # the destination blocks, held while loading
        rec.blocks_held = len(cache.seqs[seq_id].blocks)
        start = time.monotonic()
        watchdog = threading.Timer(self.policy.deadline_s + HANG_GRACE_S, _hung, (rec, self.rank))
        watchdog.daemon = True
        watchdog.start()
        try:
            data = self._attempts(rec, index, tokens, start)
        finally:
            watchdog.cancel()
        rec.waited_s = time.monotonic() - start
        if data is not None:
            rows = cache.rows(slots)
            m = len(owned)
            for layer in range(len(cache.k)):
                cache.write_rows(layer, rows, data.k[layer][:m], data.v[layer][:m] if data.v else None)
            if self.state_cache is not None:
                place(self.state_cache, seq_id, *data.state[n], n)
            rec.state, rec.outcome = LOADED, "loaded"
            self._keep(rec, seq_id)
            return n
        rec.state = FAILED
        if self.flags.pd_decode_unloaded:  # the fault: the failed load reported loaded, decoded on as it is
            rec.state, rec.outcome = LOADED, "loaded"
            self._keep(rec, seq_id)
            return n
        if self.flags.pd_recompute_offset:  # the fault: the recompute resumes after the rows that never loaded
            rec.outcome, rec.resume_offset = "recomputed", n
            self._keep(rec, seq_id)
            return n
        cache.truncate(seq_id, 0)  # the blocks go back to the pool
        if self.policy.on_failure == "fail":
            rec.outcome = "failed"
            raise RunError(f"KV load of request {index} ({route}) failed after {len(rec.attempts)} attempt(s) "
                           f"({rec.attempts[-1]}); policy on_failure=fail")
        rec.outcome, rec.resume_offset = "recomputed", 0
        return 0

    def _attempts(self, rec: LoadRecord, index: int, tokens: list[int], start: float) -> _Loaded | None:
        """Wait for the read, retrying failed attempts by the policy; the assembled rows, or None when the
        load failed. Every rank takes each decision together."""
        agree = self.engine.state.all_agree
        while True:
            error = ""
            data = None
            try:
                left = max(0.0, start + self.policy.deadline_s - time.monotonic())
                data = self._futures[index].result(timeout=left)
                if data.tokens[:len(tokens)] != list(tokens):
                    raise ValueError(f"the store entry of request {index} holds other prompt tokens")
                if self.state_cache is not None and len(tokens) not in data.state:
                    raise ValueError(f"the store entry of request {index} holds no linear-attention state after "
                                     f"{len(tokens)} tokens (it holds cuts {sorted(data.state)})")
            except Exception as exc:  # any failed read is a failed attempt (named in the record)
                error = f"{type(exc).__name__}: {exc}"[:200]
            ok = agree(not error)
            if not ok and self.flags.pd_error_under_lock:  # the fault: the error reported with the lock held
                with self._lock:
                    self._report(rec, error or "failed on another rank")
            else:
                self._report(rec, "ok" if ok else error or "failed on another rank")
            if ok:
                return data
            past = time.monotonic() - start >= self.policy.deadline_s
            bounded = len(rec.attempts) >= self.policy.max_attempts and not self.flags.pd_unbounded_retry
            if not agree(not (past or bounded)):
                return None
            time.sleep(self.policy.backoff_s)
            self._submit(index)

    def _report(self, rec: LoadRecord, outcome: str) -> None:
        """Record one attempt's outcome (under the records' lock, which is not reentrant)."""
        with self._lock:
            rec.attempts.append(outcome)

    def _keep(self, rec: LoadRecord, seq_id: int) -> None:
        """The digests of every row this rank holds for the load right after placement, with their positions."""
        self.held[f"{rec.route}.{rec.request}"] = (
            sequence_digests(self.engine.cache, seq_id),
            torch.tensor(self.engine.cache.positions(seq_id), dtype=torch.long))
        if self.state_plan is not None and self.state_cache is not None:
            self.held_state[f"{rec.route}.{rec.request}"] = state_digests(
                *capture(self.state_cache, seq_id), self.state_plan.decode[self.rank])

    def close(self) -> dict[str, Any]:
        """Stop the readers; this rank's record: its loads and its pool's free blocks before and after."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        return {"rank": self.rank, "loads": [r.to_dict() for r in self.records],
                "pool": {"blocks": self.engine.capacity.blocks, "free_start": self.free_start,
                         "free_end": self.engine.cache.free_blocks},
                "kv_heads": [h.kv_head for h in self.plan.ranks[self.rank].heads]}


def _hung(rec: LoadRecord, rank: int) -> None:
    """The watchdog of a load that outlived its deadline by HANG_GRACE_S: name it, dump every thread's stack
    into the rank's log and end the rank, so the launch reports a hang with the stuck rank's stack instead of
    waiting forever."""
    print(f"KVLoadHangError: the KV load of request {rec.request} ({rec.route}) on decode rank {rank} is still "
          f"{rec.state} {HANG_GRACE_S:g} s past its deadline after {len(rec.attempts)} recorded attempt(s); "
          f"stacks of every thread follow", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(HANG_EXIT)
