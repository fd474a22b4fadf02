"""The embedded engine's sampler: a request's SamplingParams applied to its logits after the vocab gather (every
rank holds the whole [B, V] row, decoder.logits), in the order harness/specs/sampling.py states, and a token drawn
by inverse CDF from the request's own seeded generator. Every rank runs the same arithmetic on the same gathered
logits with the same generator state, so every rank draws the same token without an exchange.

A sampler slip (FaultFlags.sampler_slip, harness/engine/runtime/faults.py) reproduces one real sampling bug:
  topk-per-shard          top-k applied within each TP rank's vocab shard (the union of the shards' top-k kept)
  temperature-after-mask  min-p / top-k / top-p masks computed on the untempered logits, the temperature after
  penalty-own-slice       penalties count only the history tokens in the rank's own vocab shard
  rank-seed               each rank's generator seeded with seed + its TP rank (ranks draw different tokens)
  row-mapping             batched top-p maps each row's kept set back through the next row's sort order
  unrenormalized          the kept mass not renormalized and the uniform draw not scaled to it
  shared-generator        a batch's rows all draw from the first row's generator (no per-request seeds)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from harness.partition.layout import vocab_shard
from harness.specs.sampling import SamplingParams

SLIPS: tuple[str, ...] = ("topk-per-shard", "temperature-after-mask", "penalty-own-slice", "rank-seed",
                          "row-mapping", "unrenormalized", "shared-generator")


@dataclass(frozen=True)
class Sampler:
    """One workload's sampler on one rank: its params, the vocabulary's TP shards (shards[r] = token ids [lo, hi)
    of TP rank r, layout.vocab_shard) and this rank's TP rank, and the slip it carries ("" : none)."""

    params: SamplingParams
    shards: tuple[tuple[int, int], ...]
    tp_rank: int = 0
    slip: str = ""

    @classmethod
    def of(cls, params: SamplingParams, vocab: int, tp: int, tp_rank: int, slip: str = "") -> Sampler:
        if slip and slip not in SLIPS:
            raise ValueError(f"unknown sampler slip {slip!r}; valid: {', '.join(SLIPS)}")
        return cls(params, tuple(vocab_shard(vocab, r, tp) for r in range(tp)), tp_rank, slip)

    def generator(self, seed: int) -> torch.Generator:
        """A request's generator (seed + the TP rank under the rank-seed slip)."""
        return torch.Generator().manual_seed(seed + (self.tp_rank if self.slip == "rank-seed" else 0))

    # -- the processed distribution -------------------------------------------------------------

    def _penalized(self, logits: torch.Tensor, prompts: Sequence[Sequence[int]],
                   outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Penalties applied to float64 logits [B, V] of rows whose history is prompts[b] + outputs[b]."""
        p = self.params
        x = logits.clone()
        lo, hi = self.shards[self.tp_rank] if self.slip == "penalty-own-slice" else (0, x.shape[-1])
        for b, (prompt, output) in enumerate(zip(prompts, outputs)):
            seen = torch.tensor(sorted({t for t in (*prompt, *output) if lo <= t < hi}), dtype=torch.long)
            if p.repetition_penalty != 1.0 and len(seen):
                row = x[b, seen]
                x[b, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            out = torch.tensor([t for t in output if lo <= t < hi], dtype=torch.long)
            if len(out):
                counts = torch.bincount(out, minlength=x.shape[-1]).to(x.dtype)  # [V]
                x[b] -= p.presence_penalty * (counts > 0).to(x.dtype) + p.frequency_penalty * counts
        return x

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        """The kept tokens [B, V] (bool) of float64 logits x [B, V]: min-p, top-k, then top-p."""
        p = self.params
        probs = torch.softmax(x, dim=-1)  # [B, V]
        keep = probs >= p.min_p * probs.max(dim=-1, keepdim=True).values if p.min_p > 0 else torch.ones_like(x).bool()
        if p.top_k:
            keep &= self._top_k(x)
        if p.top_p < 1.0:
            masked = probs.masked_fill(~keep, 0.0)
            if self.slip != "unrenormalized":
                masked = masked / masked.sum(dim=-1, keepdim=True)
            order = masked.argsort(dim=-1, descending=True, stable=True)  # [B, V]
            if self.slip == "row-mapping" and x.shape[0] > 1:
                order = order.roll(-1, dims=0)  # row b maps back through row b + 1's sort order
            ranked = masked.gather(-1, order)  # [B, V] descending (the right row's own values)
            before = ranked.cumsum(dim=-1) - ranked  # mass of the tokens ranked above each one
            keep_sorted = before < p.top_p
            keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
        return keep

    def _top_k(self, x: torch.Tensor) -> torch.Tensor:
        """[B, V] bool: the top_k largest logits (ties at the k-th value kept), over the whole row or, under the
        topk-per-shard slip, within each vocab shard."""
        k = self.params.top_k
        spans = self.shards if self.slip == "topk-per-shard" else ((0, x.shape[-1]),)
        keep = torch.zeros_like(x, dtype=torch.bool)
        for lo, hi in spans:
            part = x[:, lo:hi]  # [B, hi - lo]
            if hi - lo <= k:
                keep[:, lo:hi] = True
                continue
            kth = part.topk(k, dim=-1).values[:, -1:]  # [B, 1]
            keep[:, lo:hi] = part >= kth
        return keep

    def probabilities(self, logits: torch.Tensor, prompts: Sequence[Sequence[int]],
                      outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """The processed distribution [B, V] float64 of logits [B, V] (sums to 1; the unrenormalized slip: to the
        kept mass)."""
        x = self._penalized(logits.to(torch.float64), prompts, outputs)
        t = self.params.temperature
        if self.slip == "temperature-after-mask":
            keep = self._keep(x)
            x = x / t
        else:
            x = x / t
            keep = self._keep(x)
        probs = torch.softmax(x, dim=-1).masked_fill(~keep, 0.0)  # [B, V]
        return probs if self.slip == "unrenormalized" else probs / probs.sum(dim=-1, keepdim=True)

    # -- drawing --------------------------------------------------------------------------------

    def uniforms(self, generators: Sequence[torch.Generator], n: int = 1) -> torch.Tensor:
        """n uniforms [B, n] float64 per row, row b from generators[b] (the shared-generator slip: all from the
        first row's)."""
        gens = [generators[0]] * len(generators) if self.slip == "shared-generator" else generators
        return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in gens])  # [B, n]

    def draw(self, probs: torch.Tensor, generators: Sequence[torch.Generator], n: int = 1) -> torch.Tensor:
        """n tokens per row of probs [B, V], row b from generators[b] (self.pick of self.uniforms); [B, n] int64."""
        return self.pick(probs, self.uniforms(generators, n))

    def pick(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The tokens [B, n] of uniforms u [B, n] under probs [B, V]: inverse CDF over the tokens in descending
        probability (ties by id), each uniform scaled to the row's total mass."""
        order = probs.argsort(dim=-1, descending=True, stable=True)  # [B, V]
        cdf = probs.gather(-1, order).cumsum(dim=-1)  # [B, V]
        scaled = u if self.slip == "unrenormalized" else u * cdf[:, -1:]
        at = torch.searchsorted(cdf, scaled, right=True).clamp(max=probs.shape[-1] - 1)  # [B, n]
        return order.gather(-1, at)

    def sample(self, logits: torch.Tensor, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
               generators: Sequence[torch.Generator], n: int = 1) -> torch.Tensor:
        """n draws [B, n] from the processed distribution of each row of logits [B, V]."""
        return self.draw(self.probabilities(logits, prompts, outputs), generators, n)
