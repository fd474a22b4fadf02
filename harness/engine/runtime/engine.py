"""Engine: one rank's model, KV cache and what a run asks of it.

- teacher-forced logits on the prefill path (one forward over a whole sequence),
- teacher-forced logits on the decode path (a short prefill, then one token at a time through the
  cache), with per-layer hidden states and per-head attention outputs captured at probe positions,
- the sequence API (open, extend, truncate, close) and the decoder that greedy generation steps through:
  harness/engine/runtime/scheduler.py is the one generation loop (plain, served, workloads, speculative).
Every rank calls the same methods in the same order (lockstep); all ranks return the same results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.core.errors import ConfigError
from harness.engine.fault import FaultFlags
from harness.engine.layers.dense import Batch, Capture
from harness.engine.layers.dp_moe import owner_of
from harness.engine.runtime.decoders import RankBuild, build_rank
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.parallelize import rank_report
from harness.partition.layout import ROUND_ROBIN, Placement
from harness.records.rankreport import RankReport, StoredPositions
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.topology import Topology

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class Generation:
    """Greedy generation of one batch: new tokens and top-k (ids, logprobs) per step, per sequence, and
    how many sequences could run at once at most (`width`: max_batch as the KV pool allows it). Of a
    speculative generation: no top-k rows, and per sequence the accepted draft tokens (0..k) and the k
    proposals of each verify step."""

    tokens: list[list[int]]
    topk_ids: list[torch.Tensor]
    topk_logprobs: list[torch.Tensor]
    width: int = 0
    accepted: list[list[int]] = field(default_factory=list)
    drafts: list[list[list[int]]] = field(default_factory=list)
    uniforms: list[list[float]] = field(default_factory=list)  # a sampled generation: each step's uniform


@dataclass(frozen=True)
class DecodePath:
    """Teacher-forced decode of one sequence: logits [T-D, V], hidden [L+1, P, H], attn [L, P, heads, hd],
    collectives [tp, L, P, sites] (each rank's error of each collective's output in unit roundoffs,
    contract.COLLECTIVES)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    attn: torch.Tensor
    collectives: torch.Tensor


# A KV source for a sequence's leading tokens (the decode side of a disaggregated run, pd_connector.py):
# (empty seq_id, request index, the tokens wanted) -> how many leading tokens it placed in the cache (0: none)
PrefixLoader = Callable[[int, int, list[int]], int]

LONG_SEQUENCE = 128  # a prefill batch mixing sequences longer than this with shorter ones runs as two batches
FORWARD_TOKENS = 4096  # padded tokens one forward of a generation step holds at most (token_groups)


def length_buckets(lengths: Sequence[int], limit: int = LONG_SEQUENCE) -> list[list[int]]:
    """Indices of `lengths` in up to two batches, those up to `limit` tokens and the longer ones, so short
    sequences are not padded to a long one's length (one more forward, far less padded compute)."""
    short = [i for i, n in enumerate(lengths) if n <= limit]
    long = [i for i, n in enumerate(lengths) if n > limit]
    return [b for b in (short, long) if b]


def token_groups(indices: Sequence[int], lengths: Sequence[int], limit: int = FORWARD_TOKENS) -> list[list[int]]:
    """`indices` (into `lengths`) in consecutive groups of at most `limit` padded tokens each (rows x the
    group's longest; a longer row alone): one forward per group keeps its activations small enough for the
    CPU's caches (smollm2-135m, 16 prompts of 1280 tokens: 57 s in one forward, 44 s in forwards of 2-4)."""
    groups: list[list[int]] = []
    widest = 0
    for i in indices:
        if groups and (len(groups[-1]) + 1) * max(widest, lengths[i]) <= limit:
            groups[-1].append(i)
            widest = max(widest, lengths[i])
        else:
            groups.append([i])
            widest = lengths[i]
    return groups


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
                 placement: Placement = ROUND_ROBIN, q_replicated: bool = False, dp: int = 1) -> None:
        self.spec = spec
        self.state = state
        self.flags = flags
        self.dtype = TORCH_DTYPES[dtype or spec.dtype]
        self.pool = pool
        # the batch-invariant mode (backend embedded:batch-invariant): the serving loop runs every request's rows in
        # a forward of their own, so a request's logits do not depend on the rest of its batch (scheduler._forward)
        self.batch_invariant = False
        self._owner_probe: StoredPositions | None = None  # the first decode-path sequence's stored positions
        self.dp = dp  # attention data parallel: a request runs (and is stored) on DP rank owner_of(seq_id) only
        self.model = model_of(spec)  # its components: the attention's engine module builds the decoder (decoders.py)
        topology = Topology(tp=state.tp, dcp=state.dcp, speculator=speculator, q_replicated=q_replicated, ep=ep, dp=dp,
                            interleave=placement.size, contiguous=placement.kind == "contiguous")
        parts = build_rank(RankBuild(spec, plan_model(self.model, topology), full_weights, state, flags,
                                     pool.budget_bytes, pool.max_seq_len, pool.block_size, self.dtype))
        self.plan, self.rank_layout, self.heads = parts.plan, parts.rank_layout, parts.heads
        self.capacity, self.cache, self.decoder = parts.capacity, parts.cache, parts.decoder
        self._weights, self._report, self._params = parts.weights, parts.report, parts.params
        self.parts = parts.own  # the MLA or hybrid module's own parts (None for dense attention)

    @property
    def max_batch(self) -> int:
        return self.capacity.slots

    def layout_report(self) -> RankReport:
        """What this rank holds (layout.json's rank report), with its MLA or hybrid record."""
        extra = self._report()  # what the attention component's engine module adds (decoders.py)
        return rank_report(self.rank_layout, self.heads, self._weights, self.spec, self.cache.pool_bytes,
                           self.capacity.blocks, extra.checksums, extra.kv_bytes_per_token, self._owner_probe,
                           extra.mla_record, extra.hybrid_record, extra.sparse_record, self._params,
                           extra.experts_record)

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

    # -- sequence API: speculative decoding drives the target through these -----------------------------

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

    @torch.inference_mode()
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

    @torch.inference_mode()
    def decode_path(self, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                    probes: Sequence[Sequence[int]], loader: PrefixLoader | None = None) -> list[DecodePath]:
        """Prefill each sequence's first starts[i] tokens (those a `loader` places are loaded, not computed),
        then feed the rest one token per step."""
        self.check_lengths([len(s) for s in sequences])
        out: list[DecodePath] = []
        for part in self._batches(len(sequences)):
            out += self._decode_batch([sequences[i] for i in part], [starts[i] for i in part],
                                      [probes[i] for i in part], list(part), loader)
        return out

    def _decode_batch(self, seqs: list[Sequence[int]], starts: list[int], probes: list[Sequence[int]],
                      indices: list[int], loader: PrefixLoader | None) -> list[DecodePath]:
        ids = self.cache.open(len(seqs))
        loaded = [loader(ids[b], indices[b], list(seqs[b][:starts[b]])) if loader else 0 for b in range(len(seqs))]
        rest = [b for b in range(len(seqs)) if loaded[b] < starts[b]]
        for bucket in length_buckets([starts[b] - loaded[b] for b in rest]):  # short and long apart
            chosen = [rest[j] for j in bucket]
            self._forward([ids[b] for b in chosen], [seqs[b][loaded[b]:starts[b]] for b in chosen],
                          [loaded[b] for b in chosen])
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
        runs_first = self.dp == 1 or owner_of(ids[0], self.dp) == self.state.rank
        if self._owner_probe is None and runs_first:  # what this rank stored of the first sequence (layout check)
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
