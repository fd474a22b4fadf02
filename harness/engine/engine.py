"""Engine: one rank's model, KV cache and the three things a run asks of it.

- teacher-forced logits on the prefill path (one forward over a whole sequence),
- teacher-forced logits on the decode path (a short prefill, then one token at a time through the
  cache), with per-layer hidden states and per-head attention outputs captured at probe positions,
- batched greedy generation with per-step top-k log-probabilities.
Every rank calls the same methods in the same order (lockstep); all ranks return the same results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from harness.engine.faults import FaultFlags
from harness.engine.hybrid import HybridParts, build_hybrid, hybrid_layout_report
from harness.engine.kvcache import PagedKVCache
from harness.engine.mla import MLAParts, build_mla, mla_report
from harness.engine.model import Batch, Capture, Decoder, Hyper
from harness.engine.parallel import ParallelState
from harness.engine.parallelize import engine_plan, head_map, rank_report, shard_weights
from harness.errors import ConfigError
from harness.layout import ROUND_ROBIN, LayoutPlan, Placement, pool_capacity
from harness.rankreport import RankReport, StoredPositions
from harness.specs.hybrid_plan import check_hybrid_dcp
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings

MIN_SHARED_PREFIX_BLOCKS = 1  # generate() computes a common prompt prefix once when it spans this many KV blocks
StopCheck = Callable[[int, list[int]], bool]  # (prompt index, its new tokens so far) -> stop now?
Abandoned = Callable[[], Collection[int]]  # asked once per step: prompt indices to drop now

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class Generation:
    """Greedy generation of one batch: new tokens and top-k (ids, logprobs) per step, per sequence, and
    how many sequences ran at once at most (`width`: max_batch as the KV pool allows it)."""

    tokens: list[list[int]]
    topk_ids: list[torch.Tensor]
    topk_logprobs: list[torch.Tensor]
    width: int = 0


@dataclass(frozen=True)
class DecodePath:
    """Teacher-forced decode of one sequence: logits [T-D, V], hidden [L+1, P, H], attn [L, P, heads, hd],
    collectives [tp, L, P, sites] (each rank's error of each collective's output in unit roundoffs,
    contract.COLLECTIVES)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    attn: torch.Tensor
    collectives: torch.Tensor


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


LONG_SEQUENCE = 128  # a prefill batch mixing sequences longer than this with shorter ones runs as two batches


def length_buckets(lengths: Sequence[int], limit: int = LONG_SEQUENCE) -> list[list[int]]:
    """Indices of `lengths` in up to two batches, those up to `limit` tokens and the longer ones, so short
    sequences are not padded to a long one's length (one more forward, far less padded compute)."""
    short = [i for i, n in enumerate(lengths) if n <= limit]
    long = [i for i, n in enumerate(lengths) if n > limit]
    return [b for b in (short, long) if b]


def build_batch(seq_ids: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int],
                device: torch.device) -> Batch:
    """Right-padded batch of new tokens `chunks[b]` placed at positions starts[b]...; [B, S] tensors."""
    width = max(len(c) for c in chunks)
    ids = torch.tensor([list(c) + [0] * (width - len(c)) for c in chunks], dtype=torch.long).view(len(chunks), width)
    lengths = torch.tensor([len(c) for c in chunks])  # [B]
    valid = torch.arange(width)[None, :] < lengths[:, None]  # [B, S]
    positions = torch.tensor(list(starts))[:, None] + torch.arange(width)[None, :]  # [B, S]
    return Batch(tuple(seq_ids), ids.to(device), positions.to(device), valid.to(device))


class Engine:
    """The model of one rank, built from full weights and the (possibly faulty) layout plan."""

    def __init__(self, spec: ModelSpec, full_weights: dict[str, torch.Tensor], state: ParallelState,
                 flags: FaultFlags = FaultFlags(), pool: PoolSettings = PoolSettings(),
                 dtype: str | None = None, ep: int = 1, speculator: str = "none",
                 placement: Placement = ROUND_ROBIN, q_replicated: bool = False) -> None:
        self.spec = spec
        self.state = state
        self.flags = flags
        self.dtype = TORCH_DTYPES[dtype or spec.dtype]
        self.pool = pool
        self.hybrid: HybridParts | None = None
        self._mla: MLAParts | None = None
        self._owner_probe: StoredPositions | None = None  # the first decode-path sequence's stored positions
        if spec.hybrid is not None:  # linear attention / MoE layers: harness/engine/hybrid.py
            check_hybrid_dcp(spec, placement, q_replicated)
            self._init_hybrid(full_weights, ep, speculator != "none")
            return
        self.plan: LayoutPlan = engine_plan(spec, state.tp, state.dcp, flags, placement, q_replicated)
        self.rank_layout = self.plan.ranks[state.rank]
        self.heads = head_map(self.rank_layout, flags)
        self.capacity = pool_capacity(self.plan, pool.budget_bytes, pool.max_seq_len, pool.block_size)
        if spec.mla:
            self._mla = build_mla(spec, full_weights, self.rank_layout, self.heads, state.collectives(), flags,
                                  self.capacity, self.dtype, state.device, state.tp, placement, q_replicated)
            self.cache, self.decoder, weights = self._mla.cache, self._mla.decoder, self._mla.weights
        else:
            weights = shard_weights(full_weights, spec, self.rank_layout, self.dtype, state.device)
            self.cache = PagedKVCache(self.capacity, spec.layers, self.heads.n_kv, spec.head_dim, self.dtype,
                                      state.device)
            self.decoder = Decoder(weights, self.heads, Hyper(spec.head_dim, spec.rope_theta, spec.norm_eps),
                                   state.collectives(), self.cache, flags, placement)
        self._weights = weights

    def _init_hybrid(self, full_weights: dict[str, torch.Tensor], ep: int, speculator: bool) -> None:
        state, pool = self.state, self.pool
        parts = build_hybrid(self.spec, full_weights, state.tp, state.dcp, ep, state.rank, self.flags,
                             pool.budget_bytes, pool.max_seq_len, pool.block_size,
                             Hyper(self.spec.head_dim, self.spec.rope_theta, self.spec.norm_eps),
                             state.collectives(), self.dtype, state.device, speculator)
        self.hybrid = parts
        self.plan, self.rank_layout, self.heads = parts.plan.attention, parts.rank_layout, parts.heads
        self.capacity, self.cache, self.decoder = parts.capacity, parts.cache, parts.decoder
        self._weights = parts.weights

    @property
    def max_batch(self) -> int:
        return self.capacity.slots

    def layout_report(self) -> RankReport:
        """What this rank holds (layout.json's rank report), with its MLA or hybrid record."""
        mla, sums, per_token = mla_report(self._mla, self.spec) if self._mla is not None else (None, None, None)
        hybrid = hybrid_layout_report(self.hybrid, self.state.rank) if self.hybrid is not None else None
        return rank_report(self.rank_layout, self.heads, self._weights, self.spec, self.cache.pool_bytes,
                           self.capacity.blocks, sums, per_token, self._owner_probe, mla, hybrid)

    # -- building blocks ---------------------------------------------------------------------------

    def check_lengths(self, lengths: Sequence[int]) -> None:
        """A sequence longer than a pool slot would exhaust the pool mid-run: say so up front."""
        longest = max(lengths, default=0)
        if longest > self.pool.max_seq_len:
            raise ConfigError(f"a sequence of {longest} tokens exceeds max_seq_len={self.pool.max_seq_len} "
                              f"of the KV pool slots; raise --max-seq-len (or the suite's max_seq_len)")

    def _batch(self, seq_ids: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int]) -> Batch:
        return build_batch(seq_ids, chunks, starts, self.state.device)

    def _forward(self, seq_ids: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int],
                 capture: Capture | None = None) -> torch.Tensor:
        return self.decoder.forward(self._batch(seq_ids, chunks, starts), capture).float()

    def _batches(self, n: int) -> list[range]:
        step = max(1, self.max_batch)
        return [range(i, min(n, i + step)) for i in range(0, n, step)]

    # -- sequence API: speculative decoding drives the target through these ----------------------------

    def open_sequences(self, n: int) -> list[int]:
        """Register n new, empty sequences in the KV cache; returns their ids."""
        return self.cache.open(n)

    def close_sequences(self, seq_ids: Sequence[int]) -> None:
        """Free the KV blocks of finished sequences."""
        self.cache.close(seq_ids)

    def extend(self, seq_ids: Sequence[int], chunks: Sequence[Sequence[int]],
               starts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens chunks[b] at positions starts[b].. of sequence seq_ids[b] through the cache (their
        K/V is stored). Returns float32 logits [B, S, V] and the last layer's residual stream (before the
        final norm) [B, S, H], right-padded to the longest chunk."""
        hidden = self.decoder.hidden(self._batch(seq_ids, chunks, starts))
        return self.decoder.logits(hidden).float(), hidden

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll back: drop the cached K/V of positions >= length of sequence `seq_id`."""
        self.cache.truncate(seq_id, length)

    def stored_positions(self, seq_id: int) -> list[int]:
        """Positions whose K/V this rank holds for `seq_id` (its own tokens only, under DCP)."""
        return self.cache.positions(seq_id)

    # -- what a run asks -----------------------------------------------------------------------------

    @torch.no_grad()
    def prefill_logits(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Logits [T_i, V] of each whole sequence from one batched prefill forward."""
        self.check_lengths([len(s) for s in sequences])
        out: list[torch.Tensor] = []
        for part in self._batches(len(sequences)):
            seqs = [sequences[i] for i in part]
            ids = self.cache.open(len(seqs))
            logits = self._forward(ids, seqs, [0] * len(seqs))
            out += [logits[b, :len(s)].cpu() for b, s in enumerate(seqs)]
            self.cache.close(ids)
        return out

    @torch.no_grad()
    def decode_path(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                    probes: Sequence[Sequence[int]]) -> list[DecodePath]:
        """Prefill each sequence's first starts[i] tokens, then feed the rest one token per step."""
        self.check_lengths([len(s) for s in sequences])
        out: list[DecodePath] = []
        for part in self._batches(len(sequences)):
            out += self._decode_batch([sequences[i] for i in part], [starts[i] for i in part],
                                      [probes[i] for i in part])
        return out

    def _decode_batch(self, seqs: list[Sequence[int]], starts: list[int],
                      probes: list[Sequence[int]]) -> list[DecodePath]:
        ids = self.cache.open(len(seqs))
        for bucket in length_buckets(starts):  # the prefix before decode starts: short and long apart
            self._forward([ids[b] for b in bucket], [seqs[b][:starts[b]] for b in bucket], [0] * len(bucket))
        logits: list[list[torch.Tensor]] = [[] for _ in seqs]
        hidden: list[list[torch.Tensor]] = [[] for _ in seqs]
        attn: list[list[torch.Tensor]] = [[] for _ in seqs]
        sites: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in range(max(len(s) - d for s, d in zip(seqs, starts))):
            active = [b for b, (s, d) in enumerate(zip(seqs, starts)) if d + step < len(s)]
            pos = [starts[b] + step for b in active]
            # capture (hidden states, attention, collective errors) only in steps with a probe position
            cap = Capture() if any(p in probes[b] for b, p in zip(active, pos)) else None
            step_logits = self._forward([ids[b] for b in active], [[seqs[b][p]] for b, p in zip(active, pos)],
                                        pos, cap)
            for j, (b, p) in enumerate(zip(active, pos)):
                logits[b].append(step_logits[j, 0].cpu())
                if cap is not None and p in probes[b]:
                    hidden[b].append(torch.stack([h[j, 0] for h in cap.hidden]).float().cpu())  # [L+1, H]
                    attn[b].append(torch.stack([a[j, 0] for a in cap.attn]))  # [L, n_q, hd]
                    sites[b].append(torch.stack([c[j, 0] for c in cap.collectives]))  # [L, sites]
        if self._owner_probe is None:  # what this rank stored of the first sequence, for the layout check
            first = self.cache.seqs[ids[0]]
            self._owner_probe = StoredPositions(len(seqs[0]), first.prompt_len, tuple(first.positions))
        self.cache.close(ids)
        return [DecodePath(logits=torch.stack(lg), hidden=torch.stack(hd, dim=1),
                           attn=self._gather_heads(torch.stack(at, dim=1)),
                           collectives=self._gather_ranks(torch.stack(st, dim=1)))
                for lg, hd, at, st in zip(logits, hidden, attn, sites)]

    def _gather_ranks(self, errors: torch.Tensor) -> torch.Tensor:
        """[L, P, sites] of this rank -> [tp, L, P, sites], rank order."""
        return self.decoder.comm.gather_tp(errors.unsqueeze(0), dim=0).float().cpu()

    def _gather_heads(self, attn: torch.Tensor) -> torch.Tensor:
        """[L, P, n_q_local, hd] -> [L, P, heads, hd] in global head order (rank order = head order)."""
        return self.decoder.comm.gather_tp(attn, dim=2).float().cpu()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_k: int = 5,
                 stop_token_ids: frozenset[int] = frozenset(), stop: StopCheck | None = None,
                 max_batch: int | None = None, share_prefix: bool = True,
                 abandoned: Abandoned | None = None) -> Generation:
        """Greedy generation with continuous batching: up to `max_batch` (default: the pool's slots)
        sequences run together, and a finished sequence's slot is refilled with the next prompt at once.
        A sequence stops at a stop token, when stop(index, new_tokens) says so (e.g. a stop string in
        its text; it must answer alike on every rank), or after max_new_tokens. `abandoned()`, asked
        before every step (it must answer alike on every rank: `harness serve` broadcasts rank 0's
        answer), names prompts nobody waits for any more: they stop at once, running or queued, with
        the tokens they have.
        With `share_prefix`, the prompts' common prefix (when it fills a KV block) is computed once and
        its cached K/V copied into each new sequence, which then prefills only its own tokens."""
        self.check_lengths([len(p) + max_new_tokens for p in prompts])
        width = max(1, min(self.max_batch, max_batch or self.max_batch))
        shared = shared_prefix_length(prompts) if share_prefix and self.max_batch > 1 else 0
        if shared < MIN_SHARED_PREFIX_BLOCKS * self.pool.block_size:
            shared = 0
        prefix: list[int] = []
        if shared:
            width = min(width, self.max_batch - 1)  # the prefix holds one slot of the pool
            prefix = self.cache.open(1)
            self.decoder.hidden(self._batch(prefix, [prompts[0][:shared]], [0]))
        new: list[list[int]] = [[] for _ in prompts]
        tk_ids: list[list[torch.Tensor]] = [[] for _ in prompts]
        tk_lp: list[list[torch.Tensor]] = [[] for _ in prompts]
        queue = list(range(len(prompts)))[::-1]  # popped from the end: prompts in the order given
        running: dict[int, int] = {}  # prompt index -> sequence id, in admission order
        while queue or running:
            gone = set(abandoned()) if abandoned is not None else set()
            if gone:
                queue = [b for b in queue if b not in gone]
                self.cache.close([running.pop(b) for b in list(running) if b in gone])
                if not (queue or running):
                    break
            decoding = list(running)
            rows = [self._step_logits(decoding, running, prompts, new)] if decoding else []
            admitted = [queue.pop() for _ in range(min(len(queue), width - len(running)))]
            if admitted:
                opened = self.cache.fork(prefix[0], len(admitted)) if prefix else self.cache.open(len(admitted))
                running.update(zip(admitted, opened))
                rows.append(self._prompt_logits([prompts[i] for i in admitted], [running[i] for i in admitted],
                                                shared))
            order = decoding + admitted
            logprobs = torch.log_softmax(torch.cat(rows).double(), dim=-1)  # [B, V]
            top = torch.topk(logprobs, k=min(top_k, logprobs.shape[-1]), dim=-1)
            picked = top.indices[:, 0].tolist()
            ids_cpu, lp_cpu = top.indices.cpu(), top.values.float().cpu()
            finished = []
            for j, b in enumerate(order):
                new[b].append(picked[j])
                tk_ids[b].append(ids_cpu[j])
                tk_lp[b].append(lp_cpu[j])
                if (len(new[b]) >= max_new_tokens or picked[j] in stop_token_ids
                        or (stop is not None and stop(b, new[b]))):
                    finished.append(b)
            self.cache.close([running.pop(b) for b in finished])
        self.cache.close(prefix)
        k = min(top_k, self.spec.vocab)  # a prompt dropped before its first step has no rows
        return Generation(new, [torch.stack(t) if t else torch.empty((0, k), dtype=torch.long) for t in tk_ids],
                          [torch.stack(t) if t else torch.empty((0, k)) for t in tk_lp], width)

    def _prompt_logits(self, prompts: list[Sequence[int]], seq_ids: list[int], cached: int = 0) -> torch.Tensor:
        """Prefill new sequences whose first `cached` tokens are already in the cache; float32 logits
        [B, V] of each prompt's last position only."""
        hidden = self.decoder.hidden(self._batch(seq_ids, [p[cached:] for p in prompts],
                                                 [cached] * len(prompts)))  # [B, S, H]
        last = torch.tensor([len(p) - cached - 1 for p in prompts], device=hidden.device)
        last_hidden = hidden[torch.arange(len(prompts), device=hidden.device), last]  # [B, H]
        return self.decoder.logits(last_hidden[:, None])[:, 0].float()

    def _step_logits(self, order: list[int], running: dict[int, int], prompts: Sequence[Sequence[int]],
                     new: list[list[int]]) -> torch.Tensor:
        """One decode step of running sequences (their latest token in); float32 logits [B, V]."""
        pos = [len(prompts[b]) + len(new[b]) - 1 for b in order]
        return self._forward([running[b] for b in order], [[new[b][-1]] for b in order], pos)[:, 0]
