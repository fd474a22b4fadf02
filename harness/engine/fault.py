"""What a fault is: a known bug the engine can be told to have (`Fault`, declared beside the code it breaks, in
the `faults` module of that package), and the switches the engine's code reads (`FaultFlags`). The catalog of all
faults is harness/engine/faults.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

# why a fault cannot act on (spec, topology) given its flags, or None: a scope rule of the code the fault breaks
InertRule = Callable[[str, ModelSpec, Topology, "FaultFlags"], "str | None"]


@dataclass(frozen=True)
class Fault:
    """A bug the engine can be told to have; `check` is the check that must flag it, `flags` the FaultFlags fields it
    sets, `inert` its own scope rule (the components' rules, harness/arch/scope.py, apply to every fault)."""

    name: str
    check: str
    description: str
    needs_dcp: bool = False
    needs_tp: bool = False      # acts only with tp > 1 (a collective that a tp1 run never calls)
    needs_speculator: str = ""  # "": none; "any": a draft or MTP speculator; "draft" / "mtp": that kind
    needs_placement: str = ""   # "": any; "interleave" (an i<K> topology, K > 1) / "contiguous" (c)
    needs_q_replicated: bool = False  # acts only on a Q-replicated topology (suffix q)
    shared: bool = False        # the bug sits in code the reference topology runs too (e.g. verification):
    #                             the reference run gets it as well, so only a stored baseline can see it
    needs_pd: bool = False      # acts only on a disaggregated topology (PREFILL>DECODE)
    flags: Mapping[str, Any] = field(default_factory=dict, hash=False)
    inert: InertRule | None = field(default=None, compare=False)


@dataclass(frozen=True)
class FaultFlags:
    """What the engine does differently under a fault (all False/None = correct engine)."""

    kv_layout_dcp: int | None = None
    naive_gqa: bool = False
    lse_merge_mean: bool = False
    store_on_all_dcp_ranks: bool = False
    speculator_kv_dcp: bool = False     # draft-dcp-kv-heads: speculator KV split by tp // dcp
    speculator_stale_kv: bool = False   # draft-stale-kv: no rollback of the speculator's cache
    mtp_hidden_shift: int = 0           # mtp-wrong-hidden: MTP reads the target hidden this many positions early
    verify_skip_last: bool = False      # spec-verify-last-draft: the verify loop never accepts the k-th draft
    store_padding: bool = False         # dcp-store-padding: DCP K/V store ignores batch.valid
    reduce_dtype: str | None = None     # bf16-allreduce: the TP all-reduce done in this dtype
    reduce_attn_only: bool = False      # fp16-attn-allreduce: ... only that of the attention output
    split_reduction: int = 0            # noise perturbation (not a fault): row-parallel contractions
    #                                     split into this many partial sums added in another order
    vocab_floor_offset: bool = False    # vocab-shard-offset: vocab shard offsets by floor(vocab / tp)
    ffn_floor_split: bool = False       # ffn-floor-split: ffn // tp MLP columns per rank
    rope_local_positions: bool = False  # dcp-rope-local-pos: keys rotated by their local store index
    o_proj_offset: bool = False         # o-proj-shard-offset: output projection columns of heads h + 1
    mlp_norm_other_layer: bool = False  # mlp-norm-other-layer: ranks > 0 take layer i + 1's MLP norm
    # hybrid models (harness/engine/layers/hybrid.py)
    linear_packed_contiguous: bool = False  # deltanet-packed-split: packed q|k|v rows split contiguously
    linear_state_dcp_split: bool = False    # deltanet-state-dcp-split: state updated by own DCP tokens only
    shared_expert_every_rank: bool = False  # moe-shared-every-rank: the whole shared expert on every rank
    expert_offset_tp_rank: bool = False     # moe-expert-offset: expert ids offset by the tp rank, not the EP rank
    router_local_renorm: bool = False       # moe-router-local-renorm: top-k weights renormalized per rank
    dp_pad_local_count: bool = False        # dp-pad-local-count: gathered MoE rows masked by the local count
    dp_dummy_wrap: bool = False             # dp-dummy-topk-wrap: a dummy token's id -1 and combine index wrap
    replica_local_first: bool = False       # redundant-expert-twice: each rank picks its own replica
    dp_shared_unreduced: bool = False       # dp-shared-unreduced: the shared expert's partial not all-reduced
    cache_groups_own_budget: bool = False   # cache-groups-own-budget: each cache group from its own budget share
    mtp_hidden_dcp_owner: bool = False      # mtp-dcp-hidden-owner: MTP reads DCP rank 0's latest position
    stale_state_slots: bool = False         # state-slot-stale: a reused state slot keeps its old state
    interleave_per_token: bool = False  # dcp-interleave-per-token: K/V stored by t % dcp, read by chunks of K
    contiguous_global_len: bool = False  # dcp-contiguous-global-len: blocks sized by the batch's tokens
    lse_base2: bool = False             # dcp-lse-base2: partial LSEs in base 2 to a natural-log merge
    empty_lse_zero: bool = False        # dcp-empty-shard-lse0: a shard with no key merged with LSE 0
    latent_rope_local_slot: bool = False  # mla-rope-local-slot: the latent's RoPE key by its local slot
    q_own_slice: bool = False           # q-replicated-own-slice: the group's Q weights = own slice repeated
    prefix_hit_local: bool = False      # dcp-prefix-hit-length: a hit resumes at n x block_size tokens
    prefix_never_hits: bool = False     # prefix-cache-never-hits: the prefix cache's lookup finds nothing
    spec_logprob_shift: bool = False    # spec-logprob-shift: a speculative step's logprobs from the next row
    chunk_restart: bool = False         # dcp-chunk-restart: later chunks' positions restart at 0 on dcp ranks > 0
    resume_gap: int = 0                 # preempt-resume-position: recomputed new tokens shifted this far
    batched_decode: bool = False        # batch-variant-decode: the batch-invariant mode still batches decode rows
    sampler_slip: str = ""              # sample-*: the sampler's slip (harness/engine/runtime/sampler.py SLIPS)
    block_table_width: int = 0          # block-table-wrap: block-table entries per sequence (0: unbounded)
    empty_shard_nan: bool = False       # dcp-empty-shard-nan: an empty DCP shard returns NaN
    # sparse attention (harness/engine/layers/sparse.py)
    dsa_local_topk: bool = False        # dsa-local-topk: each DCP rank's own top-k used as the selection
    dsa_index_shift: int = 0            # dsa-indexer-offset: the indexer's key range shifted this many positions
    dsa_sinks_evicted: bool = False     # dsa-sinks-evicted: sinks compete by score past index_topk
    dsa_row_rule: str = "contiguous"    # dsa-planner-rows: the attention's rule for the selection of a row
    dsa_groups_unaligned: bool = False  # dsa-groups-unaligned: the indexer-key group from its own budget share
    dsa_weights_offset: bool = False    # dsa-indexer-weights-offset: index_w rows of the next rank's heads
    # disaggregated prefill/decode (harness/engine/pd/prefill.py, pd_connector.py)
    pd_head_offset: bool = False        # pd-head-offset: destination head slot = the source's slice index
    pd_naive_gqa: bool = False          # pd-gqa-replication: KV head h read from prefill rank h
    pd_block_owner: bool = False        # pd-block-owner: received tokens dealt to DCP ranks by whole blocks
    pd_early_release: bool = False      # pd-early-release: prefill blocks released before their send
    pd_recompute_offset: bool = False   # pd-recompute-offset: recompute after a failed load resumes at n
    pd_unbounded_retry: bool = False    # pd-unbounded-retry: failed loads retried without a bound
    pd_decode_unloaded: bool = False    # pd-decode-unloaded: a failed load reported loaded
    pd_error_under_lock: bool = False   # pd-error-under-lock: a failed attempt reported with the lock held
    pd_state_conv_shift: bool = False   # pd-state-conv-shift: the received conv state placed one token late
    pd_state_same_rank: bool = False    # pd-state-same-rank: decode rank r's state read from prefill rank r
    pd_lost_request: int = -1           # the request whose stored KV is never committed (-1: none)
    pd_flaky_reads: bool = False        # pd-load-flaky: every request's first read fails
    pd_never_reads: bool = False        # pd-load-never-reads: every read of an undamaged store fails
