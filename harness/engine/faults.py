"""Known-bug injections: each reproduces one real layout bug class, silently, only in parallel runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.core.errors import ConfigError
from harness.specs.loader import did_you_mean
from harness.specs.topology import Topology


@dataclass(frozen=True)
class Fault:
    """A bug the engine can be told to have; `check` is the check that must flag it."""

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


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("dcp-tp-kv-layout", "layout, logits_decode",
          "under DCP, KV heads assigned by the TP-only layout (kv_tp_size = tp), so ranks of one DCP group "
          "hold different KV heads and the merged attention mixes them (SGLang Qwen3.5 TP4/DCP4: GSM8K 0.880)",
          needs_dcp=True),
    Fault("gcd-naive-gqa", "layout, logits",
          "the local Q->KV mapping by repeat_interleave of local head counts instead of global head indices "
          "(wrong when KV heads are GCD-duplicated, e.g. heads=24 kv=6 tp=4; rtp-llm)"),
    Fault("dcp-lse-merge", "logits_decode",
          "DCP partial attention outputs averaged without their log-sum-exp weights", needs_dcp=True),
    Fault("dcp-token-owner", "logits_decode",
          "during decode the new token's K/V is stored on every rank of its DCP group instead of only on its "
          "owner (t % dcp), so the LSE merge counts it several times", needs_dcp=True),
    Fault("draft-dcp-kv-heads", "speculator_layout",
          "the speculator's KV heads and KV pool computed with the target's dcp (kv_tp_size = tp // dcp) "
          "although it is not part of the DCP group: its KV pool is over-allocated (SGLang draft worker, "
          "CI OOM); output and acceptance unchanged", needs_dcp=True, needs_speculator="any"),
    Fault("draft-stale-kv", "acceptance, acceptance_per_position",
          "rejected draft tokens' K/V not rolled back in the speculator's cache, so later proposals attend "
          "to them: acceptance drops, greedy output stays lossless", needs_speculator="any"),
    Fault("bf16-allreduce", "logits",
          "the TP all-reduce of the row-parallel projections (attention output, MLP down) done in bfloat16 "
          "in a float32 model: every partial sum rounded to 8 bits of mantissa (a comm-precision regression: "
          "thousands of times the noise of a correct run on tiny-gqa tp2, no crash)", needs_tp=True),
    Fault("fp16-attn-allreduce", "logits",
          "only the attention-output all-reduce done in float16 in a float32 model (partials rounded to 11 "
          "bits): a subtle precision regression, a few hundred times the noise of a correct run, that the "
          "old hand-set floors passed with a WARN", needs_tp=True),
    Fault("dcp-store-padding", "logits_decode",
          "under DCP the owner mask of the K/V store ignores the batch's right-padding, so the padding "
          "slots of a ragged batch (prompts of different lengths) are stored as keys at later positions "
          "and attended; inert when every sequence of a batch has the same length", needs_dcp=True),
    Fault("mtp-wrong-hidden", "acceptance",
          "the MTP module fed the target's hidden state of the wrong position (t-1 instead of t): its "
          "proposals change (a trained MTP's acceptance drops; a synthetic one's accept trace leaves the "
          "reference's), greedy output stays lossless", needs_speculator="mtp"),
    # a bug in the speculative verify step, which the tp1 reference runs too: acceptance_baseline flags it
    Fault("spec-verify-last-draft", "acceptance_baseline, acceptance_per_position",
          "the verify step's accept loop bounded by k - 1 instead of k (the bonus position taken for the "
          "last draft position), so the last proposal is never accepted and the target's own token is "
          "committed in its place: output stays lossless and identical in the tp1 reference, which shares "
          "the verify code, but fully accepted steps (k + 1 tokens) never happen and the mean accepted "
          "length drops", needs_speculator="any", shared=True),
    # -- uneven splits and DCP positions (vocab-parallel embedding / lm_head, FFN shards, DCP RoPE) --
    Fault("vocab-shard-offset", "layout, logits",
          "vocab-parallel embedding / lm_head shards of ceil(vocab / tp) rows loaded from offset "
          "rank * floor(vocab / tp): on an uneven split neighbouring shards overlap by one row per rank, "
          "boundary tokens are embedded twice and the gathered logits of later ranks are shifted by one "
          "id per rank; inert when tp divides the vocabulary", needs_tp=True),
    Fault("ffn-floor-split", "layout, logits",
          "an intermediate size that tp does not divide split as ffn // tp columns per rank: the last "
          "ffn % tp MLP columns are computed by no rank (an engine assuming divisibility); inert when tp "
          "divides the FFN width", needs_tp=True),
    Fault("o-proj-shard-offset", "layout, logits",
          "the row-parallel attention output projection loaded one head to the right of the rank's own Q "
          "heads (columns of heads h + 1): every rank's attention output is projected through its "
          "neighbour's columns, while the attention heads themselves stay right", needs_tp=True),
    Fault("mlp-norm-other-layer", "layout, logits",
          "on every rank but rank 0 the MLP input norm of layer i loaded from layer i + 1 (a replicated "
          "weight taken from the wrong place on some ranks): the ranks normalize the MLP input differently; "
          "inert on a one-layer model", needs_tp=True),
    Fault("dcp-rope-local-pos", "logits",
          "under DCP the keys are rotated (RoPE) by their index in the rank's local KV store (t // dcp) "
          "instead of their global position t, while the queries use global positions: relative "
          "positions are wrong for every key but the first", needs_dcp=True),
    # -- hybrid models: Gated DeltaNet, MoE with expert parallel, grouped caches (harness/engine/layers/hybrid.py) --
    Fault("deltanet-packed-split", "layout, logits",
          "the packed q|k|v in_proj and conv1d rows of a linear-attention layer split as one contiguous "
          "slice per rank instead of per component, so ranks mix q, k and v channels of other heads "
          "(Megatron-LM #1989); inert where one rank holds every linear head", needs_tp=True),
    Fault("deltanet-state-dcp-split", "logits",
          "under DCP each rank folds only the tokens it owns (t % dcp) into the linear-attention recurrent "
          "state, as if the state were split by token like the KV cache (vLLM #36480): the state of each "
          "rank misses the other ranks' tokens", needs_dcp=True),
    Fault("moe-shared-every-rank", "layout, logits",
          "the shared expert computed whole on every rank and added before the TP all-reduce, so it is "
          "counted tp times (vLLM #37856: garbled output with EP and TP)", needs_tp=True),
    Fault("moe-expert-offset", "layout, logits",
          "each rank's expert ids offset by its tp rank instead of its EP rank, so with 1 < ep < tp ranks "
          "route tokens to experts whose weights they do not hold; inert where ep is 1 or tp"),
    Fault("moe-router-local-renorm", "logits",
          "the top-k routing weights renormalized per EP rank over the experts that rank holds, not over "
          "all k chosen experts: tokens split across EP ranks get weights that sum past 1; inert at ep=1"),
    # -- attention data parallel and redundant experts (harness/engine/layers/dp_moe.py, docs/moe-dp.md) --
    Fault("dp-pad-local-count", "logits, generation",
          "under attention DP the gathered MoE buffer masked with this rank's local token count instead of each "
          "DP rank's own count within the padded (global) batch: tokens of DP ranks with more tokens lose this "
          "rank's expert outputs (SGLang #40643: GSM8K 0.14-0.26 vs 0.55); only with unequal DP batches",
          needs_tp=True),
    Fault("dp-dummy-topk-wrap", "logits, generation",
          "an idle DP rank's dummy token, routed with top-k id -1, read as the last expert (the -1 wraps) and "
          "its output combined at index -1 of the real tokens: added to the last real token (vLLM #57787); "
          "only in steps with an idle DP rank", needs_tp=True),
    Fault("redundant-expert-twice", "logits, generation",
          "with redundant experts each rank picks the replica it holds itself instead of the one the shared "
          "rule picks, so an expert replicated on two EP ranks is computed and summed twice (SGLang #32962: "
          "GSM8K 0.63 -> 0.42); inert without replicas (redundant_experts=0 happens to be correct)",
          needs_tp=True),
    Fault("dp-shared-unreduced", "logits, generation",
          "under attention DP the shared expert's column-parallel partial sum added to the DP rank's own tokens "
          "without the all-reduce over the world: each token gets one rank's share of the shared expert "
          "(tpu-inference #3435)", needs_tp=True),
    Fault("cache-groups-own-budget", "layout",
          "each cache group (attention KV pages, recurrent-state slots) sized from its own share of the "
          "budget, so the groups hold different numbers of sequences instead of one slot count (pypto "
          "grouped cache capacity)"),
    Fault("state-slot-stale", "self_consistency",
          "a recurrent-state slot handed to a new sequence without zeroing its conv and recurrent state, so "
          "a sequence that reuses a freed slot starts from the previous occupant's final state (modular #6681: "
          "cold requests right, later ones corrupted); in code the tp1 reference runs too, so every parity "
          "check agrees; inert on models without linear attention", shared=True),
    Fault("spec-logprob-shift", "speculative_logprobs",
          "a speculative server returns each generated step's logprobs from the row after it (the verify "
          "forward's rows indexed from the first draft instead of the last committed token): tokens and "
          "acceptance unchanged, the logprobs a client reads are those of the next position; acts behind "
          "`harness serve` (the embedded engine's speculative path returns no logprobs)", needs_speculator="any"),
    Fault("mtp-dcp-hidden-owner", "acceptance",
          "under DCP the MTP module fed the target hidden state of the latest position owned by DCP rank 0 "
          "(q - q % dcp) instead of q, the same wrong state on every rank, as a draft built for dcp=1 would "
          "(local-inference-lab vLLM #72): every cross-rank comparison agrees, greedy output stays lossless, "
          "the proposals change", needs_dcp=True, needs_speculator="mtp"),
    # -- MLA and the DCP token placements (harness/engine/layers/mla.py, layout.token_owner) --
    Fault("mla-rope-local-slot", "logits",
          "under DCP the MLA latent's decoupled RoPE key rotated by the token's slot in its owner's local "
          "latent cache instead of its global position (queries keep global positions)", needs_dcp=True),
    Fault("dcp-interleave-per-token", "layout, logits",
          "with an interleaved placement (chunks of K tokens) the K/V store deals tokens one by one (t % dcp) "
          "while the attention reads each rank's share by chunks ((t // K) % dcp, as its local sequence "
          "lengths say): rows are read as the wrong tokens", needs_dcp=True, needs_placement="interleave"),
    Fault("dcp-contiguous-global-len", "layout, logits",
          "with the contiguous placement the K/V store sizes each sequence's blocks by the whole batch's "
          "token count instead of the sequence's own length, while the attention reads per-sequence "
          "blocks: ranks read rows they never stored", needs_dcp=True, needs_placement="contiguous"),
    Fault("dcp-lse-base2", "logits",
          "the partial attention's LSE handed to the DCP merge in base 2 (a kernel's log2 of the sum) "
          "while the merge exponentiates in base e: partials weighted wrongly (SGLang FA3 / base-2 reducer)",
          needs_dcp=True),
    Fault("dcp-empty-shard-lse0", "logits",
          "a DCP rank that holds no visible token for a query returns LSE 0 instead of -inf, so the merge "
          "gives its zero output a real weight (vLLM / vllm-ascend empty-shard merge)", needs_dcp=True),
    Fault("q-replicated-own-slice", "layout, logits",
          "Q-replicated DCP loading only the rank's own slice of q_b_proj / w_kc for every head of its DCP "
          "group, so the other heads' queries are computed with the wrong weights", needs_dcp=True,
          needs_q_replicated=True),
    # -- serving routes: prefix cache, chunked prefill, preemption, long block tables, short sequences --
    Fault("dcp-prefix-hit-length", "generation, prefix_cache",
          "a prefix-cache hit of n KV blocks resumes the prefill at n x block_size tokens instead of "
          "n x block_size x dcp (the DCP virtual block), so every DCP rank stores the tokens in between a "
          "second time and the LSE merge counts them twice; only on prefix-cache hits, inert at dcp 1",
          needs_dcp=True),
    Fault("prefix-cache-never-hits", "features_on",
          "the prefix cache's lookup never finds a cached block (e.g. a block hash keyed by something that "
          "differs per request), so every request prefills its whole prompt: outputs unchanged, the prefix-cache "
          "route silently off (SGLang #30968's class: a feature that is off passes every parity check); "
          "prefix-cache workload only"),
    Fault("dcp-chunk-restart", "generation, chunked_prefill",
          "in chunked prefill the positions of every chunk after the first restart at 0 on DCP ranks > 0 "
          "(a chunk offset taken from the rank's local store): those ranks rotate their Q heads and keys "
          "by the wrong positions and store the wrong tokens; only prompts longer than the chunk budget",
          needs_dcp=True),
    Fault("preempt-resume-position", "preemption",
          "a preempted sequence recomputed with its generated tokens one position too far (a gap after "
          "the prompt): every later step attends with shifted relative positions; only preempted sequences"),
    Fault("block-table-wrap", "logits, generation",
          "the block table kept with room for 2 blocks per sequence: a rank's blocks past the 2nd are read "
          "from the first ones (the keys of other positions); only sequences storing more than "
          "2 x block_size tokens on a rank"),
    Fault("dcp-empty-shard-nan", "logits_decode, generation",
          "a DCP rank that holds no token of a sequence returns NaN partial outputs (a kernel dividing by "
          "an empty softmax sum) instead of 0 with LSE -inf, and the merge spreads the NaN; only sequences "
          "shorter than dcp (vLLM PR #47541)", needs_dcp=True),
    # -- sparse attention (DeepSeek-V3.2 DSA style, harness/engine/layers/sparse.py) --
    Fault("dsa-local-topk", "layout, logits",
          "under DCP each rank attends the top-k of the tokens it stores itself, its local candidates taken "
          "as the global selection (no merge over the DCP group): the merged attention reads dcp x k tokens, "
          "not the group's top-k (Ascend SGLang #146: DSA under attention context parallel, GSM8K 0.05 vs 0.5)",
          needs_dcp=True),
    Fault("dsa-indexer-offset", "layout, logits",
          "the indexer's key range per query (ks, ke) shifted by one position: position 0 is never a "
          "candidate and the next token is (SGLang #12583: wrong ks/ke offsets into the indexer's top-k, "
          "accuracy loss on DeepSeek-V3.2)"),
    Fault("dsa-sinks-evicted", "layout, logits",
          "the always-kept first tokens (index_sinks) dropped once a query sees more than index_topk tokens: "
          "they compete by score like any other token (mlx-lm #1443: a cliff at 2048 tokens)"),
    Fault("dsa-planner-rows", "layout, logits",
          "under DCP the indexer selects for contiguous shards of query rows but the attention reads row s's "
          "selection by a round-robin planner: rows take other rows' token sets, fluent and wrong (SGLang "
          "test_dsa_cp_indexer_row_agreement)", needs_dcp=True),
    Fault("dsa-indexer-weights-offset", "layout, logits",
          "each TP rank's indexer head weights (index_w, which sum its heads' scores) taken from the next rank's "
          "heads while its Q rows are its own: every score weighs the wrong heads, the token selection drifts "
          "(a wrong slice of a per-head parameter next to the one the layout check compared)", needs_tp=True),
    Fault("dsa-groups-unaligned", "layout",
          "the indexer-key cache group sized from an equal share of the budget in blocks, not the one slot "
          "count x its blocks per slot: its capacity is another number of slots than the KV group's, often "
          "no whole number (seed 004's fallback capacities); output unchanged"),
    # -- disaggregated prefill/decode: the KV transfer and its load path (harness/engine/pd/connector.py) --
    Fault("pd-head-offset", "pd_transfer, logits_decode",
          "heterogeneous TP: a decode rank writes each received KV head at the slice index it had on its prefill "
          "rank instead of its own index for that head (SGLang #22145: wrong destination head offset); inert "
          "where every head keeps its slice index (same KV layout on both sides)", needs_pd=True),
    Fault("pd-gqa-replication", "pd_transfer, logits_decode",
          "prefill tp above the KV head count: KV head h read from prefill rank h as if each held one distinct "
          "head, though GCD duplication put head h // dup there (vllm-ascend #3366); inert unless the prefill "
          "side duplicates KV heads", needs_pd=True),
    Fault("pd-block-owner", "pd_transfer, logits_decode",
          "the decode side deals received tokens to its DCP ranks by whole blocks while its attention deals "
          "them by the topology's placement (the DCP token owner computed differently on the two sides)",
          needs_pd=True, needs_dcp=True),
    Fault("pd-early-release", "pd_transfer, logits_decode",
          "the prefill side releases a request's blocks right after its forward, before its asynchronous send "
          "read them; the next request gets the same blocks and the late send ships its KV under the first "
          "one's name (vLLM NIXL KV digest: a request silently reads another request's KV)", needs_pd=True),
    Fault("pd-recompute-offset", "pd_load, logits_decode",
          "with request 1's stored KV lost, the recompute after the failed load resumes at the offset the load "
          "was to reach instead of 0 and the load is logged as handled (vLLM #49250, "
          "kv_load_failure_policy=recompute)", needs_pd=True),
    Fault("pd-unbounded-retry", "pd_load",
          "with request 1's stored KV lost, the failed load is retried without a bound while the request holds "
          "its blocks (rtp-llm loadCacheDone retried forever); the harness's deadline ends the wait",
          needs_pd=True),
    Fault("pd-error-under-lock", "hang",
          "with request 1's stored KV lost, the failed attempt is reported while the lock that reporting takes is "
          "held (rtp-llm reportError under output_mutex_): the rank deadlocks; the load's watchdog reports the hang "
          "with every thread's stack and ends the rank (an ERROR cell naming it), never a wait forever",
          needs_pd=True),
    Fault("pd-decode-unloaded", "pd_load, pd_transfer",
          "with request 1's stored KV lost, the failed load is reported loaded and the decode computes on "
          "blocks that never loaded (LMCache #3388; rtp-llm decode on an errored stream)", needs_pd=True),
    Fault("pd-state-conv-shift", "pd_transfer, logits_decode",
          "a hybrid model's transferred conv state placed one token late on the decode side: the window's newest "
          "input dropped, its oldest slot zero (an off-by-one in the state's cut between prefill and decode); "
          "inert on a model without linear attention", needs_pd=True),
    Fault("pd-state-same-rank", "pd_transfer, logits_decode",
          "a hybrid model's linear-attention state read by decode rank r from prefill rank r, its i-th V (K) head "
          "slice from that rank's i-th, as if both sides split the V heads alike (the head slice taken from the "
          "wrong prefill rank under heterogeneous TP); inert where prefill rank r holds decode rank r's heads",
          needs_pd=True),
)}
# Conditions of a correct engine's surroundings, not bugs: the load path must absorb them (a clean cell
# passes under them). pd-load-lost: request 1's stored KV never committed; pd-load-flaky: every first read fails.
LOAD_CONDITIONS: dict[str, str] = {
    "pd-load-lost": "request 1's stored KV never committed: its loads fail, are retried, then recomputed from 0",
    "pd-load-flaky": "every request's first read of the KV store fails: the retry loads it",
    # store damage between the two phases (harness/records/pd_files.py damage_store; applied by the backend)
    "pd-store-missing": "every stored KV file deleted between prefill and decode: the decode side must compute the "
                        "prompts itself, never decode on KV it did not load",
    "pd-store-truncated": "every stored KV file cut to half its size between prefill and decode: its load fails",
    "pd-store-corrupt": "every stored KV tensor's bytes rotated by half its length between prefill and decode (the "
                        "file parses, the values are other rows' KV): a decode side that loads it decodes on wrong "
                        "KV, which the checks must flag",
}
PD_LOST_REQUEST = 1  # the request whose stored KV the lost-entry faults and condition lose
BLOCK_TABLE_WIDTH = 2  # block-table-wrap: blocks per sequence the faulty table holds


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


# Perturbations of a correct engine (not faults: no bug, only another reduction order). The noise run
# of a cell is the reference topology run under one of these, in the model's own dtype.
PERTURBATIONS: dict[str, FaultFlags] = {
    "noise-reduction-order": FaultFlags(split_reduction=4),
}


SHARED_JOIN = "+"  # "<perturbation>+<fault>": a noise run carrying a fault in code the reference runs too


def fault_flags(name: str | None, topology: Topology) -> FaultFlags:
    """The engine switches for fault `name` on `topology`; a fault that cannot apply is a ConfigError.
    "<perturbation>+<fault>" (the noise run of a shared fault, Fault.shared) sets both."""
    if name is None:
        return FaultFlags()
    if SHARED_JOIN in name:
        perturbation, fault = name.split(SHARED_JOIN, 1)
        if perturbation not in PERTURBATIONS or fault not in FAULTS or not FAULTS[fault].shared:
            raise ConfigError(f"fault {name!r}: '{SHARED_JOIN}' joins a perturbation ({', '.join(PERTURBATIONS)}) "
                              f"and a shared fault ({', '.join(n for n, f in FAULTS.items() if f.shared)})")
        return dataclasses.replace(fault_flags(fault, topology), **{
            f.name: getattr(PERTURBATIONS[perturbation], f.name) for f in dataclasses.fields(FaultFlags)
            if getattr(PERTURBATIONS[perturbation], f.name) != getattr(FaultFlags(), f.name)})
    if name in PERTURBATIONS:
        return PERTURBATIONS[name]
    if name in LOAD_CONDITIONS:
        if topology.prefill is None:
            raise ConfigError(f"load condition {name} needs a disaggregated topology (e.g. tp4>tp2), got "
                              f"{topology.name}")
        return FaultFlags(pd_lost_request=PD_LOST_REQUEST if name == "pd-load-lost" else -1,
                          pd_flaky_reads=name == "pd-load-flaky")
    if name not in FAULTS:
        known = (*FAULTS, *LOAD_CONDITIONS)
        raise ConfigError(f"unknown fault {name!r}{did_you_mean(name, known)}; valid: {', '.join(known)}")
    fault = FAULTS[name]
    if fault.needs_pd and topology.prefill is None:
        raise ConfigError(f"fault {name} needs a disaggregated topology (PREFILL>DECODE, e.g. tp4>tp2dcp2), "
                          f"got {topology.name}")
    if fault.needs_dcp and topology.dcp == 1:
        raise ConfigError(f"fault {name} needs a DCP topology (dcp > 1), got {topology.name}")
    if fault.needs_tp and topology.tp == 1:
        raise ConfigError(f"fault {name} needs a tensor-parallel topology (tp > 1), got {topology.name}")
    if fault.needs_placement and topology.placement.kind != fault.needs_placement or (
            fault.needs_placement == "interleave" and topology.placement.size == 1):
        example = f"tp{topology.tp}dcp{topology.dcp}" + ("i16" if fault.needs_placement == "interleave" else "c")
        raise ConfigError(f"fault {name} needs a {fault.needs_placement} DCP placement (e.g. {example}), "
                          f"got {topology.name}")
    if fault.needs_q_replicated and not topology.q_replicated:
        raise ConfigError(f"fault {name} needs a Q-replicated DCP topology (suffix q, e.g. "
                          f"tp{topology.tp}dcp{topology.dcp}q), got {topology.name}")
    wanted = fault.needs_speculator
    if wanted and (topology.speculator == "none" or wanted not in ("any", topology.speculator)):
        kind = "a -draft or -mtp" if wanted == "any" else f"a -{wanted}"
        raise ConfigError(f"fault {name} needs {kind} topology (speculative decoding), got {topology.name}")
    return FaultFlags(
        kv_layout_dcp=1 if name == "dcp-tp-kv-layout" else None,
        naive_gqa=name == "gcd-naive-gqa",
        lse_merge_mean=name == "dcp-lse-merge",
        store_on_all_dcp_ranks=name == "dcp-token-owner",
        speculator_kv_dcp=name == "draft-dcp-kv-heads",
        speculator_stale_kv=name == "draft-stale-kv",
        mtp_hidden_shift=1 if name == "mtp-wrong-hidden" else 0,
        reduce_dtype={"bf16-allreduce": "bfloat16", "fp16-attn-allreduce": "float16"}.get(name),
        reduce_attn_only=name == "fp16-attn-allreduce",
        store_padding=name == "dcp-store-padding",
        verify_skip_last=name == "spec-verify-last-draft",
        vocab_floor_offset=name == "vocab-shard-offset",
        ffn_floor_split=name == "ffn-floor-split",
        rope_local_positions=name == "dcp-rope-local-pos",
        o_proj_offset=name == "o-proj-shard-offset",
        mlp_norm_other_layer=name == "mlp-norm-other-layer",
        linear_packed_contiguous=name == "deltanet-packed-split",
        linear_state_dcp_split=name == "deltanet-state-dcp-split",
        shared_expert_every_rank=name == "moe-shared-every-rank",
        expert_offset_tp_rank=name == "moe-expert-offset",
        router_local_renorm=name == "moe-router-local-renorm",
        dp_pad_local_count=name == "dp-pad-local-count",
        dp_dummy_wrap=name == "dp-dummy-topk-wrap",
        replica_local_first=name == "redundant-expert-twice",
        dp_shared_unreduced=name == "dp-shared-unreduced",
        cache_groups_own_budget=name == "cache-groups-own-budget",
        mtp_hidden_dcp_owner=name == "mtp-dcp-hidden-owner",
        stale_state_slots=name == "state-slot-stale",
        interleave_per_token=name == "dcp-interleave-per-token",
        contiguous_global_len=name == "dcp-contiguous-global-len",
        lse_base2=name == "dcp-lse-base2",
        empty_lse_zero=name == "dcp-empty-shard-lse0",
        latent_rope_local_slot=name == "mla-rope-local-slot",
        q_own_slice=name == "q-replicated-own-slice",
        prefix_hit_local=name == "dcp-prefix-hit-length",
        prefix_never_hits=name == "prefix-cache-never-hits",
        spec_logprob_shift=name == "spec-logprob-shift",
        chunk_restart=name == "dcp-chunk-restart",
        resume_gap=1 if name == "preempt-resume-position" else 0,
        block_table_width=BLOCK_TABLE_WIDTH if name == "block-table-wrap" else 0,
        empty_shard_nan=name == "dcp-empty-shard-nan",
        dsa_local_topk=name == "dsa-local-topk",
        dsa_index_shift=1 if name == "dsa-indexer-offset" else 0,
        dsa_sinks_evicted=name == "dsa-sinks-evicted",
        dsa_row_rule="round-robin" if name == "dsa-planner-rows" else "contiguous",
        dsa_groups_unaligned=name == "dsa-groups-unaligned",
        dsa_weights_offset=name == "dsa-indexer-weights-offset",
        pd_head_offset=name == "pd-head-offset",
        pd_naive_gqa=name == "pd-gqa-replication",
        pd_block_owner=name == "pd-block-owner",
        pd_early_release=name == "pd-early-release",
        pd_recompute_offset=name == "pd-recompute-offset",
        pd_unbounded_retry=name == "pd-unbounded-retry",
        pd_decode_unloaded=name == "pd-decode-unloaded",
        pd_error_under_lock=name == "pd-error-under-lock",
        pd_state_conv_shift=name == "pd-state-conv-shift",
        pd_state_same_rank=name == "pd-state-same-rank",
        pd_lost_request=PD_LOST_REQUEST if name in ("pd-recompute-offset", "pd-unbounded-retry",
                                                    "pd-decode-unloaded", "pd-error-under-lock") else -1,
    )
