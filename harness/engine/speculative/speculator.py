"""Speculators: a draft model or a DeepSeek-style MTP module, built from the target's weights.

- draft: a separate small model sharing the target's vocabulary and tokenizer: the target's first
  `spec.speculator_layers` layers, its final norm and lm_head, plus seeded relative noise of scale
  `draft_noise` on the layer weights, so its agreement with the target (and so the acceptance) is a knob.
- mtp: `spec.speculator_layers` decoder layer(s) fed with
      x_p = eh_proj @ concat[hnorm(h_{p-1}); enorm(embed(token_p))],   eh_proj: [H, 2H]
  where h_{p-1} is the target's last-layer residual state at position p-1 (the MTP module's own output
  during a proposal chain); its output at p, through its own final norm and the target's (shared)
  embedding and lm_head, predicts token p+1. An MLA target's MTP is DeepSeek-V3's as vLLM and SGLang run it
  (arch: Speculator.deepseek_mtp): latent-attention layers, h the target's final-normed output (its own
  final-normed output in a chain), and the embedding of its first entry (position 1, paired with h_0) zeroed.
  A checkpoint's own MTP layer (spec.nextn_layers: DeepSeek-V3's format) replaces the synthetic one.
  Synthetic init: copies of the target's first layers, and an eh_proj passing the token embedding at the
  target's embedding scale plus `mtp_hidden_mix` x the hidden state (see `mtp_weights`,
  harness/formats/speculator.py).

Agreement on synthetic models. A random target's next token is a chaotic function of its whole
depth: a speculator with fewer layers than the target (or one that must predict from the hidden state
alone) agrees on few tokens (mean accepted length ~1.1-1.3 at k=3 on the tiny models with
speculator_layers=1). Give the tiny models speculator_layers = layers; then draft_noise 0.1 and
mtp_hidden_mix 0.1 give mean accepted lengths of ~1.9-2.0 at k=3 (tiny-gqa). The hidden state carries
no extra information about a random target's future, so on synthetic models it only perturbs the MTP's
proposals (mtp-wrong-hidden changes them without a systematic drop; the acceptance check's trace gate
flags that).

A speculator is not part of the DCP group: it runs its own Decoder over its own PagedKVCache with the
plain TP layout of harness.partition.layout.plan_speculator (dcp = 1) and a dcp = 1 view of the TP group, even
when the target runs with DCP. Its KV pool holds as many sequence slots as the target's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.engine.fault import FaultFlags
from harness.engine.layers.dense import Decoder, HeadMap, Hyper, LocalWeights, rms_norm
from harness.engine.runtime.decoders import ModuleReport, RankBuild, build_rank
from harness.engine.runtime.engine import TORCH_DTYPES, Engine, build_batch
from harness.engine.runtime.kvcache import PagedKVCache
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.parallelize import head_map, rank_report, shard_weights
from harness.formats.speculator import speculator_spec, speculator_weights
from harness.partition.layout import LayoutPlan, plan_layout, plan_speculator, slot_pool
from harness.records.rankreport import RankReport, SpeculatorReport, entry_json
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from harness.specs.topology import Topology

MTP_EXTRA: tuple[str, ...] = ("eh_proj.weight", "hnorm.weight", "enorm.weight")
DENSE_MODULE = "harness.engine.layers.dense"  # the engine module of dense/GQA attention (arch/components.py)


# ---- layout and pool ---------------------------------------------------------------------------------------


def speculator_plan(spec: ModelSpec, tp: int, dcp: int, flags: FaultFlags) -> LayoutPlan:
    """The plan the speculator actually uses: plan_speculator (plain TP, dcp = 1), unless the
    draft-dcp-kv-heads fault splits its KV heads over tp // dcp like the target's (tokens still all
    stored on every rank, since the speculator does not run DCP attention)."""
    if flags.speculator_kv_dcp:
        return plan_layout(spec.speculator_shape, tp, dcp=1, kv_dcp=dcp)
    return plan_speculator(spec.speculator_shape, tp)


# ---- the speculator of one rank ------------------------------------------------------------------------------


class Speculator:
    """One rank's draft model or MTP module over its own paged KV cache (plain TP layout, dcp = 1)."""

    def __init__(self, kind: str, spec: ModelSpec, target_weights: Mapping[str, torch.Tensor],
                 state: ParallelState, settings: SpeculativeSettings, slots: int,
                 pool: PoolSettings = PoolSettings(), flags: FaultFlags = FaultFlags(),
                 dtype: str | None = None) -> None:
        self.kind = kind
        self.spec = speculator_spec(spec)
        self.flags = flags
        self.dtype = TORCH_DTYPES[dtype or spec.dtype]
        self.state = state
        self.pool = pool
        self.expected_plan = plan_speculator(spec.speculator_shape, state.tp)
        self.plan = speculator_plan(spec, state.tp, state.dcp, flags)
        self.rank_layout = self.plan.ranks[state.rank]
        self.heads: HeadMap = head_map(self.rank_layout, FaultFlags())
        # the budget granted by the planner (plain TP layout) vs the pool this engine sizes for itself
        self.granted = slot_pool(self.expected_plan, slots, pool.max_seq_len, pool.block_size)
        self.capacity = slot_pool(self.plan, slots, pool.max_seq_len, pool.block_size)
        full = speculator_weights(kind, spec, target_weights, settings)
        self._extra = {n: full[n].to(device=state.device, dtype=self.dtype) for n in MTP_EXTRA if n in full}
        # DeepSeek's MTP reads final-normed hidden states: the target's by its final norm (model_of: deepseek_mtp)
        self.deepseek_mtp = model_of(spec).speculator.deepseek_mtp
        self._target_norm = target_weights["norm.weight"].to(device=state.device, dtype=self.dtype)
        tp_only = dataclasses.replace(state, dcp=1, dcp_group=None)  # same TP group, no DCP group
        self._module_report: ModuleReport | None = None
        if model_of(self.spec).attention.engine_module == DENSE_MODULE:
            self._weights: LocalWeights = shard_weights(full, self.spec, self.rank_layout, self.dtype, state.device)
            self.cache = PagedKVCache(self.capacity, self.spec.layers, self.heads.n_kv, spec.head_dim, self.dtype,
                                      state.device)
            self.decoder = Decoder(self._weights, self.heads, Hyper(spec.head_dim, spec.rope_theta, spec.norm_eps),
                                   tp_only.collectives(), self.cache, FaultFlags())
        else:  # another attention (MLA): built by its engine module, as the target is, on the plain TP layout
            parts = build_rank(RankBuild(self.spec, plan_model(model_of(self.spec), Topology(tp=state.tp)), full,
                                         tp_only, FaultFlags(), self.capacity.budget_bytes, pool.max_seq_len,
                                         pool.block_size, self.dtype))
            self._weights, self.cache, self.decoder = parts.weights, parts.cache, parts.decoder
            self._module_report = parts.report()

    @property
    def uses_hidden(self) -> bool:
        """An MTP module reads the target's hidden states; a draft model reads only tokens."""
        return self.kind == "mtp"

    # -- sequences ---------------------------------------------------------------------------------------

    def open_sequences(self, n: int) -> list[int]:
        return self.cache.open(n)

    def close_sequences(self, seq_ids: Sequence[int]) -> None:
        self.cache.close(seq_ids)

    def truncate(self, seq_id: int, length: int) -> None:
        self.cache.truncate(seq_id, length)

    def stored_positions(self, seq_id: int) -> list[int]:
        return self.cache.positions(seq_id)

    # -- forward -----------------------------------------------------------------------------------------

    def extend(self, seq_ids: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int],
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens chunks[b] at positions starts[b].. through the speculator's cache. An MTP module also
        takes `hidden` [B, S, H]: the hidden state paired with each token (the target's at the position
        before through target_hidden, or its own output during a proposal chain). Returns float32 logits
        [B, S, V] and what its next proposal step reads of its output, recycled(x) [B, S, H] (right-padded)."""
        batch = build_batch(seq_ids, chunks, starts, self.state.device)
        embeds = None
        if self.uses_hidden:
            if hidden is None or hidden.shape[:2] != batch.ids.shape:
                raise ValueError(f"MTP needs a hidden state per token: {tuple(batch.ids.shape)}, got "
                                 f"{None if hidden is None else tuple(hidden.shape)}")
            embeds = self._mtp_input(hidden.to(self.dtype), batch.ids, batch.positions)
        x = self.decoder.hidden(batch, embeds=embeds)
        return self.decoder.logits(x).float(), self.recycled(x)

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MTP module reads of the target's last-layer residual states [..., H]: DeepSeek's MTP the
        target's final-normed output (vLLM's and SGLang's target models return it), the harness's the states."""
        return rms_norm(hidden, self._target_norm, self.spec.norm_eps) if self.deepseek_mtp else hidden

    def recycled(self, x: torch.Tensor) -> torch.Tensor:
        """What the next proposal step reads of this module's output x [B, S, H]: DeepSeek's MTP its own
        final-normed (shared head norm) output, the harness's the residual state."""
        return rms_norm(x, self._weights.norm, self.spec.norm_eps) if self.deepseek_mtp else x

    def _mtp_input(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """eh_proj @ concat[hnorm(hidden); enorm(embed(ids))]: [B, S, 2H] -> [B, S, H]. DeepSeek's MTP zeroes the
        token embedding of its first entry (position 1, paired with the target's hidden state at position 0: vLLM
        runs that entry at position 0 and masks it; RoPE sees the same relative positions)."""
        eps = self.spec.norm_eps
        h = rms_norm(hidden, self._extra["hnorm.weight"], eps)
        embeds = self.decoder.embed(ids)  # [B, S, H]
        if self.deepseek_mtp:
            embeds = embeds.masked_fill((positions == 1)[..., None], 0.0)
        e = rms_norm(embeds, self._extra["enorm.weight"], eps)
        return torch.cat([h, e], dim=-1) @ self._extra["eh_proj.weight"].T

    # -- layout report -----------------------------------------------------------------------------------

    def layout_report(self) -> RankReport:
        """This rank's actual speculator layout (a plain TP layout; parallelize.rank_report)."""
        extra = self._module_report or ModuleReport()
        return rank_report(self.rank_layout, self.heads, self._weights, self.spec, self.cache.pool_bytes,
                           self.capacity.blocks, extra.checksums, extra.kv_bytes_per_token, mla=extra.mla_record)

    def layout_entry(self, ranks: Sequence[RankReport]) -> dict[str, Any]:
        """layout.json's "speculator" entry from every rank's layout_report(), in rank order. Its "pool"
        carries the budget the planner grants (slots x plain-TP slot size), which the speculator_layout
        check re-sizes with plan_speculator; a pool sized from another plan shows as a mismatch."""
        return entry_json(ranks, {"budget_bytes": self.granted.budget_bytes, "max_seq_len": self.pool.max_seq_len,
                                  "block_size": self.pool.block_size},
                          SpeculatorReport(kind=self.kind, layers=self.spec.layers, slots=self.granted.slots))


def speculator_for(engine: Engine, kind: str, target_weights: Mapping[str, torch.Tensor],
                   settings: SpeculativeSettings) -> Speculator:
    """The speculator of `engine`'s rank: same model, ParallelState, fault flags, dtype and slot count."""
    dtype = next(name for name, dt in TORCH_DTYPES.items() if dt == engine.dtype)
    return Speculator(kind, engine.spec, target_weights, engine.state, settings, engine.capacity.slots,
                      engine.pool, engine.flags, dtype)
