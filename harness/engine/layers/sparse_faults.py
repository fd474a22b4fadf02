"""Faults in sparse attention and its indexer (sparse.py): each reproduces one real bug of this code behind a flag
(harness/engine/fault.py); the catalog (harness/engine/faults.py) gathers them."""

from __future__ import annotations

from harness.engine.fault import Fault

FAULTS: tuple[Fault, ...] = (
    Fault("dsa-local-topk", "layout, logits",
          "under DCP each rank attends the top-k of the tokens it stores itself, its local candidates taken "
          "as the global selection (no merge over the DCP group): the merged attention reads dcp x k tokens, "
          "not the group's top-k (Ascend SGLang #146: DSA under attention context parallel, GSM8K 0.05 vs 0.5)",
          needs_dcp=True,
          flags={"dsa_local_topk": True}),
    Fault("dsa-indexer-offset", "layout, logits",
          "the indexer's key range per query (ks, ke) shifted by one position: position 0 is never a "
          "candidate and the next token is (SGLang #12583: wrong ks/ke offsets into the indexer's top-k, "
          "accuracy loss on DeepSeek-V3.2)",
          flags={"dsa_index_shift": 1}),
    Fault("dsa-sinks-evicted", "layout, logits",
          "the always-kept first tokens (index_sinks) dropped once a query sees more than index_topk tokens: "
          "they compete by score like any other token (mlx-lm #1443: a cliff at 2048 tokens)",
          flags={"dsa_sinks_evicted": True}),
    Fault("dsa-planner-rows", "layout, logits",
          "under DCP the indexer selects for contiguous shards of query rows but the attention reads row s's "
          "selection by a round-robin planner: rows take other rows' token sets, fluent and wrong (SGLang "
          "test_dsa_cp_indexer_row_agreement)", needs_dcp=True,
          flags={"dsa_row_rule": "round-robin"}),
    Fault("dsa-indexer-weights-offset", "layout, logits",
          "each TP rank's indexer head weights (index_w, which sum its heads' scores) taken from the next rank's "
          "heads while its Q rows are its own: every score weighs the wrong heads, the token selection drifts "
          "(a wrong slice of a per-head parameter next to the one the layout check compared)", needs_tp=True,
          flags={"dsa_weights_offset": True}),
    Fault("dsa-groups-unaligned", "layout",
          "the indexer-key cache group sized from an equal share of the budget in blocks, not the one slot "
          "count x its blocks per slot: its capacity is another number of slots than the KV group's, often "
          "no whole number (seed 004's fallback capacities); output unchanged",
          flags={"dsa_groups_unaligned": True}),
)
