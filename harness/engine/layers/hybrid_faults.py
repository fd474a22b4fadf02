"""Faults in the hybrid decoder (hybrid.py): Gated DeltaNet, the MoE FFN, the grouped cache: each reproduces one real
bug of this code behind a flag (harness/engine/fault.py); the catalog (harness/engine/faults.py) gathers them."""

from __future__ import annotations

from harness.engine.fault import Fault

FAULTS: tuple[Fault, ...] = (
    Fault("deltanet-packed-split", "layout, logits",
          "the packed q|k|v in_proj and conv1d rows of a linear-attention layer split as one contiguous "
          "slice per rank instead of per component, so ranks mix q, k and v channels of other heads "
          "(Megatron-LM #1989); inert where one rank holds every linear head", needs_tp=True,
          flags={"linear_packed_contiguous": True}),
    Fault("deltanet-state-dcp-split", "logits",
          "under DCP each rank folds only the tokens it owns (t % dcp) into the linear-attention recurrent "
          "state, as if the state were split by token like the KV cache (vLLM #36480): the state of each "
          "rank misses the other ranks' tokens", needs_dcp=True,
          flags={"linear_state_dcp_split": True}),
    Fault("moe-shared-every-rank", "layout, logits",
          "the shared expert computed whole on every rank and added before the TP all-reduce, so it is "
          "counted tp times (vLLM #37856: garbled output with EP and TP)", needs_tp=True,
          flags={"shared_expert_every_rank": True}),
    Fault("moe-expert-offset", "layout, logits",
          "each rank's expert ids offset by its tp rank instead of its EP rank, so with 1 < ep < tp ranks "
          "route tokens to experts whose weights they do not hold; inert where ep is 1 or tp",
          flags={"expert_offset_tp_rank": True}),
    Fault("moe-router-local-renorm", "logits",
          "the top-k routing weights renormalized per EP rank over the experts that rank holds, not over "
          "all k chosen experts: tokens split across EP ranks get weights that sum past 1; inert at ep=1",
          flags={"router_local_renorm": True}),
    Fault("cache-groups-own-budget", "layout",
          "each cache group (attention KV pages, recurrent-state slots) sized from its own share of the "
          "budget, so the groups hold different numbers of sequences instead of one slot count (pypto "
          "grouped cache capacity)",
          flags={"cache_groups_own_budget": True}),
    Fault("state-slot-stale", "self_consistency",
          "a recurrent-state slot handed to a new sequence without zeroing its conv and recurrent state, so "
          "a sequence that reuses a freed slot starts from the previous occupant's final state (modular #6681: "
          "cold requests right, later ones corrupted); in code the tp1 reference runs too, so every parity "
          "check agrees; inert on models without linear attention", shared=True,
          flags={"stale_state_slots": True}),
)
