"""Faults in the layout applied to weights (parallelize.py) and the serving loop (scheduler.py): each reproduces one
real bug of this code behind a flag (harness/engine/fault.py); the catalog (harness/engine/faults.py) gathers them."""

from __future__ import annotations

from harness.engine.fault import Fault

FAULTS: tuple[Fault, ...] = (
    Fault("dcp-tp-kv-layout", "layout, logits_decode",
          "under DCP, KV heads assigned by the TP-only layout (kv_tp_size = tp), so ranks of one DCP group "
          "hold different KV heads and the merged attention mixes them (SGLang Qwen3.5 TP4/DCP4: GSM8K 0.880)",
          needs_dcp=True,
          flags={"kv_layout_dcp": 1}),
    Fault("gcd-naive-gqa", "layout, logits",
          "the local Q->KV mapping by repeat_interleave of local head counts instead of global head indices "
          "(wrong when KV heads are GCD-duplicated, e.g. heads=24 kv=6 tp=4; rtp-llm)",
          flags={"naive_gqa": True}),
    Fault("vocab-shard-offset", "layout, logits",
          "vocab-parallel embedding / lm_head shards of ceil(vocab / tp) rows loaded from offset "
          "rank * floor(vocab / tp): on an uneven split neighbouring shards overlap by one row per rank, "
          "boundary tokens are embedded twice and the gathered logits of later ranks are shifted by one "
          "id per rank; inert when tp divides the vocabulary", needs_tp=True,
          flags={"vocab_floor_offset": True}),
    Fault("ffn-floor-split", "layout, logits",
          "an intermediate size that tp does not divide split as ffn // tp columns per rank: the last "
          "ffn % tp MLP columns are computed by no rank (an engine assuming divisibility); inert when tp "
          "divides the FFN width", needs_tp=True,
          flags={"ffn_floor_split": True}),
    Fault("o-proj-shard-offset", "layout, logits",
          "the row-parallel attention output projection loaded one head to the right of the rank's own Q "
          "heads (columns of heads h + 1): every rank's attention output is projected through its "
          "neighbour's columns, while the attention heads themselves stay right", needs_tp=True,
          flags={"o_proj_offset": True}),
    Fault("mlp-norm-other-layer", "layout, logits",
          "on every rank but rank 0 the MLP input norm of layer i loaded from layer i + 1 (a replicated "
          "weight taken from the wrong place on some ranks): the ranks normalize the MLP input differently; "
          "inert on a one-layer model", needs_tp=True,
          flags={"mlp_norm_other_layer": True}),
    Fault("dcp-prefix-hit-length", "generation, prefix_cache",
          "a prefix-cache hit of n KV blocks resumes the prefill at n x block_size tokens instead of "
          "n x block_size x dcp (the DCP virtual block), so every DCP rank stores the tokens in between a "
          "second time and the LSE merge counts them twice; only on prefix-cache hits, inert at dcp 1",
          needs_dcp=True,
          flags={"prefix_hit_local": True}),
    Fault("prefix-cache-never-hits", "features_on",
          "the prefix cache's lookup never finds a cached block (e.g. a block hash keyed by something that "
          "differs per request), so every request prefills its whole prompt: outputs unchanged, the prefix-cache "
          "route silently off (SGLang #30968's class: a feature that is off passes every parity check); "
          "prefix-cache workload only",
          flags={"prefix_never_hits": True}),
    Fault("dcp-chunk-restart", "generation, chunked_prefill",
          "in chunked prefill the positions of every chunk after the first restart at 0 on DCP ranks > 0 "
          "(a chunk offset taken from the rank's local store): those ranks rotate their Q heads and keys "
          "by the wrong positions and store the wrong tokens; only prompts longer than the chunk budget",
          needs_dcp=True,
          flags={"chunk_restart": True}),
    Fault("preempt-resume-position", "preemption",
          "a preempted sequence recomputed with its generated tokens one position too far (a gap after "
          "the prompt): every later step attends with shifted relative positions; only preempted sequences",
          flags={"resume_gap": 1}),
    Fault("batch-variant-decode", "batch_invariance",
          "the engine's batch-invariant mode (embedded:batch-invariant) still runs a step's decode rows in one "
          "forward (a kernel whose reduction order follows the batch size, behind a flag that promises "
          "invariance): a request's logprobs move by rounding with the batch it decodes in; the noise-bounded "
          "checks cannot see it, the exact ones must; acts only on an engine in that mode",
          flags={"batched_decode": True}),
    # the sampler (sampler.py): each acts on a workload with sampling settings only (the sampling workload)
    Fault("sample-topk-per-shard", "sampling_distribution",
          "top-k applied within each TP rank's vocab shard and the shards' survivors gathered (NVIDIA-NeMo/RL "
          "#1578's slip, aws-neuron/nkipy #52): up to tp x k tokens kept, draws outside the reference's top-k; "
          "sampling workload only", needs_tp=True, flags={"sampler_slip": "topk-per-shard"}),
    Fault("sample-temperature-after-mask", "sampling_distribution",
          "min-p / top-k / top-p masks computed on the untempered logits and the temperature applied after "
          "(tt-metal #52928's class: greedy CI stays green): another support and another distribution; sampling "
          "workload only", flags={"sampler_slip": "temperature-after-mask"}),
    Fault("sample-penalty-own-slice", "sampling_ranks",
          "repetition / presence / frequency penalties counting only the history tokens in the rank's own vocab "
          "shard: tokens of the other shards go unpenalized and each rank samples from its own distribution; "
          "sampling workload only", needs_tp=True, flags={"sampler_slip": "penalty-own-slice"}),
    Fault("sample-rank-seed", "sampling_ranks",
          "each rank's generator seeded with seed + its rank (tenstorrent/tt-xla #4440's class): every rank draws "
          "a token from the right distribution, but not the same one; sampling workload only", needs_tp=True,
          flags={"sampler_slip": "rank-seed"}),
    Fault("sample-row-mapping", "sampling_distribution",
          "batched top-p maps each row's kept set back through the next row's sorted-vocabulary order "
          "(Blaizzy/mlx-vlm #1094): a row keeps another row's token ids; sampling workload only",
          flags={"sampler_slip": "row-mapping"}),
    Fault("sample-unrenormalized", "sampling_distribution",
          "top-p computed on the top-k survivors without renormalizing them, and the draw's uniform not scaled "
          "to the kept mass (ml-explore/mlx-lm #388's class): a draw past the kept mass falls on the least "
          "probable token; sampling workload only", flags={"sampler_slip": "unrenormalized"}),
    Fault("sample-shared-generator", "sampling_seeded",
          "every row of a batched sampling step draws from the first row's generator instead of its request's own "
          "(per-request seeds ignored): a seeded request draws other numbers in a batch than alone; sampling "
          "workload only", flags={"sampler_slip": "shared-generator"}),
    Fault("preempt-resume-shared", "preemption",
          "preempt-resume-position in code the tp1 reference runs too: the reference's own preemption comparison "
          "and the bound scaled from it carry the bug, so only the dtype's rounding limit on that noise "
          "(compare/parity/step_rounding.py) can see it; only preempted sequences", shared=True,
          flags={"resume_gap": 1}),
)
