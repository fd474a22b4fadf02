"""Faults in the dense attention path (dense.py): the DCP K/V store, the LSE merge, RoPE positions, the block table,
the TP all-reduce: each reproduces one real bug of this code behind a flag (harness/engine/fault.py); the catalog
(harness/engine/faults.py) gathers them."""

from __future__ import annotations

from harness.engine.fault import Fault, FaultFlags
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

BLOCK_TABLE_WIDTH = 2  # block-table-wrap: blocks per sequence the faulty table holds


def _reduced_in_own_dtype(name: str, spec: ModelSpec, topology: Topology, flags: FaultFlags) -> str | None:
    """A collective moved to a lower precision that is the model's own: the engine already reduces in it."""
    if flags.reduce_dtype is not None and flags.reduce_dtype == spec.dtype:
        return (f"fault {name} is inert on {spec.name}: it does the TP all-reduce in {flags.reduce_dtype}, "
                f"which is already the model's dtype")
    return None


FAULTS: tuple[Fault, ...] = (
    Fault("dcp-lse-merge", "logits_decode",
          "DCP partial attention outputs averaged without their log-sum-exp weights", needs_dcp=True,
          flags={"lse_merge_mean": True}),
    Fault("dcp-token-owner", "logits_decode",
          "during decode the new token's K/V is stored on every rank of its DCP group instead of only on its "
          "owner (t % dcp), so the LSE merge counts it several times", needs_dcp=True,
          flags={"store_on_all_dcp_ranks": True}),
    Fault("bf16-allreduce", "logits",
          "the TP all-reduce of the row-parallel projections (attention output, MLP down) done in bfloat16 "
          "in a float32 model: every partial sum rounded to 8 bits of mantissa (a comm-precision regression: "
          "thousands of times the noise of a correct run on tiny-gqa tp2, no crash)", needs_tp=True,
          flags={"reduce_dtype": "bfloat16"}, inert=_reduced_in_own_dtype),
    Fault("fp16-attn-allreduce", "logits",
          "only the attention-output all-reduce done in float16 in a float32 model (partials rounded to 11 "
          "bits): a subtle precision regression, a few hundred times the noise of a correct run, that the "
          "old hand-set floors passed with a WARN", needs_tp=True,
          flags={"reduce_dtype": "float16", "reduce_attn_only": True}, inert=_reduced_in_own_dtype),
    Fault("dcp-store-padding", "logits_decode",
          "under DCP the owner mask of the K/V store ignores the batch's right-padding, so the padding "
          "slots of a ragged batch (prompts of different lengths) are stored as keys at later positions "
          "and attended; inert when every sequence of a batch has the same length", needs_dcp=True,
          flags={"store_padding": True}),
    Fault("dcp-rope-local-pos", "logits",
          "under DCP the keys are rotated (RoPE) by their index in the rank's local KV store (t // dcp) "
          "instead of their global position t, while the queries use global positions: relative "
          "positions are wrong for every key but the first", needs_dcp=True,
          flags={"rope_local_positions": True}),
    Fault("dcp-interleave-per-token", "layout, logits",
          "with an interleaved placement (chunks of K tokens) the K/V store deals tokens one by one (t % dcp) "
          "while the attention reads each rank's share by chunks ((t // K) % dcp, as its local sequence "
          "lengths say): rows are read as the wrong tokens", needs_dcp=True, needs_placement="interleave",
          flags={"interleave_per_token": True}),
    Fault("dcp-contiguous-global-len", "layout, logits",
          "with the contiguous placement the K/V store sizes each sequence's blocks by the whole batch's "
          "token count instead of the sequence's own length, while the attention reads per-sequence "
          "blocks: ranks read rows they never stored", needs_dcp=True, needs_placement="contiguous",
          flags={"contiguous_global_len": True}),
    Fault("dcp-lse-base2", "logits",
          "the partial attention's LSE handed to the DCP merge in base 2 (a kernel's log2 of the sum) "
          "while the merge exponentiates in base e: partials weighted wrongly (SGLang FA3 / base-2 reducer)",
          needs_dcp=True,
          flags={"lse_base2": True}),
    Fault("dcp-empty-shard-lse0", "logits",
          "a DCP rank that holds no visible token for a query returns LSE 0 instead of -inf, so the merge "
          "gives its zero output a real weight (vLLM / vllm-ascend empty-shard merge)", needs_dcp=True,
          flags={"empty_lse_zero": True}),
    Fault("block-table-wrap", "logits, generation",
          "the block table kept with room for 2 blocks per sequence: a rank's blocks past the 2nd are read "
          "from the first ones (the keys of other positions); only sequences storing more than "
          "2 x block_size tokens on a rank",
          flags={"block_table_width": BLOCK_TABLE_WIDTH}),
    Fault("dcp-empty-shard-nan", "logits_decode, generation",
          "a DCP rank that holds no token of a sequence returns NaN partial outputs (a kernel dividing by "
          "an empty softmax sum) instead of 0 with LSE -inf, and the merge spreads the NaN; only sequences "
          "shorter than dcp (vLLM PR #47541)", needs_dcp=True,
          flags={"empty_shard_nan": True}),
)
