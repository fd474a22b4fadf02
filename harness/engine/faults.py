"""Known-bug injections: each reproduces one real layout bug class, silently, only in parallel runs."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import ConfigError
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
    shared: bool = False        # the bug sits in code the reference topology runs too (e.g. verification):
    #                             the reference run gets it as well, so only a stored baseline can see it


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
    Fault("draft-stale-kv", "acceptance",
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
    Fault("spec-verify-last-draft", "acceptance_baseline",
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
    Fault("dcp-rope-local-pos", "logits",
          "under DCP the keys are rotated (RoPE) by their index in the rank's local KV store (t // dcp) "
          "instead of their global position t, while the queries use global positions: relative "
          "positions are wrong for every key but the first", needs_dcp=True),
    # -- serving routes: prefix cache, chunked prefill, preemption, long block tables, short sequences --
    Fault("dcp-prefix-hit-length", "generation, prefix_cache",
          "a prefix-cache hit of n KV blocks resumes the prefill at n x block_size tokens instead of "
          "n x block_size x dcp (the DCP virtual block), so every DCP rank stores the tokens in between a "
          "second time and the LSE merge counts them twice; only on prefix-cache hits, inert at dcp 1",
          needs_dcp=True),
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
)}
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
    prefix_hit_local: bool = False      # dcp-prefix-hit-length: a hit resumes at n x block_size tokens
    chunk_restart: bool = False         # dcp-chunk-restart: later chunks' positions restart at 0 on dcp ranks > 0
    resume_gap: int = 0                 # preempt-resume-position: recomputed new tokens shifted this far
    block_table_width: int = 0          # block-table-wrap: block-table entries per sequence (0: unbounded)
    empty_shard_nan: bool = False       # dcp-empty-shard-nan: an empty DCP shard returns NaN


# Perturbations of a correct engine (not faults: no bug, only another reduction order). The noise run
# of a cell is the reference topology run under one of these, in the model's own dtype.
PERTURBATIONS: dict[str, FaultFlags] = {
    "noise-reduction-order": FaultFlags(split_reduction=4),
}


def fault_flags(name: str | None, topology: Topology) -> FaultFlags:
    """The engine switches for fault `name` on `topology`; a fault that cannot apply is a ConfigError."""
    if name is None:
        return FaultFlags()
    if name in PERTURBATIONS:
        return PERTURBATIONS[name]
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r}{did_you_mean(name, tuple(FAULTS))}; valid: {', '.join(FAULTS)}")
    fault = FAULTS[name]
    if fault.needs_dcp and topology.dcp == 1:
        raise ConfigError(f"fault {name} needs a DCP topology (dcp > 1), got {topology.name}")
    if fault.needs_tp and topology.tp == 1:
        raise ConfigError(f"fault {name} needs a tensor-parallel topology (tp > 1), got {topology.name}")
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
        prefix_hit_local=name == "dcp-prefix-hit-length",
        chunk_restart=name == "dcp-chunk-restart",
        resume_gap=1 if name == "preempt-resume-position" else 0,
        block_table_width=BLOCK_TABLE_WIDTH if name == "block-table-wrap" else 0,
        empty_shard_nan=name == "dcp-empty-shard-nan",
    )
