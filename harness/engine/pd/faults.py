"""Faults in disaggregated prefill/decode (prefill.py, connector.py): each reproduces one real bug of this code behind
a flag (harness/engine/fault.py); the catalog (harness/engine/faults.py) gathers them."""

from __future__ import annotations

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.engine.fault import Fault, FaultFlags
from harness.partition.pd_layout import naive_head_sources
from harness.partition.pd_state import same_rank_moves
from harness.specs.model import ModelSpec
from harness.specs.topology import Topology

PD_LOST_REQUEST = 1  # the request whose stored KV the lost-entry faults and condition lose


def _placement_inert(name: str, spec: ModelSpec, topology: Topology, flags: FaultFlags) -> str | None:
    """A transfer-placement fault that reads or writes the same slices as the plan on this pair."""
    pd = plan_model(model_of(spec), topology).pd
    assert pd is not None  # the fault needs a disaggregated topology (fault_flags)
    if flags.pd_head_offset and all(h.dest_slot == h.src_slots[0] for r in pd.ranks for h in r.heads):
        return (f"fault {name} is inert on {spec.name} at {topology.name}: every KV head keeps its slice index "
                f"from the prefill rank to the decode rank")
    if flags.pd_naive_gqa and all(naive_head_sources(pd, r.rank) == r.heads for r in pd.ranks):
        return (f"fault {name} is inert on {spec.name} at {topology.name}: the prefill side does not duplicate "
                f"KV heads (prefill kv_tp_size={pd.prefill.kv_tp_size}, kv_heads={pd.prefill.shape.kv_heads})")
    return None


def _same_rank_inert(name: str, spec: ModelSpec, topology: Topology, flags: FaultFlags) -> str | None:
    """Decode rank r reading its state from prefill rank r is right where that rank holds its heads in order."""
    state = plan_model(model_of(spec), topology).pd_state_plan
    if state is not None and all(same_rank_moves(state, r) == m for r, m in enumerate(state.moves)):
        return (f"fault {name} is inert on {spec.name} at {topology.name}: every decode rank's prefill rank of the "
                f"same number holds its linear-attention heads in the same order")
    return None



FAULTS: tuple[Fault, ...] = (
    Fault("pd-head-offset", "pd_transfer, logits_decode",
          "heterogeneous TP: a decode rank writes each received KV head at the slice index it had on its prefill "
          "rank instead of its own index for that head (SGLang #22145: wrong destination head offset); inert "
          "where every head keeps its slice index (same KV layout on both sides)", needs_pd=True,
          flags={"pd_head_offset": True}, inert=_placement_inert),
    Fault("pd-gqa-replication", "pd_transfer, logits_decode",
          "prefill tp above the KV head count: KV head h read from prefill rank h as if each held one distinct "
          "head, though GCD duplication put head h // dup there (vllm-ascend #3366); inert unless the prefill "
          "side duplicates KV heads", needs_pd=True,
          flags={"pd_naive_gqa": True}, inert=_placement_inert),
    Fault("pd-block-owner", "pd_transfer, logits_decode",
          "the decode side deals received tokens to its DCP ranks by whole blocks while its attention deals "
          "them by the topology's placement (the DCP token owner computed differently on the two sides)",
          needs_pd=True, needs_dcp=True,
          flags={"pd_block_owner": True}),
    Fault("pd-early-release", "pd_transfer, logits_decode",
          "the prefill side releases a request's blocks right after its forward, before its asynchronous send "
          "read them; the next request gets the same blocks and the late send ships its KV under the first "
          "one's name (vLLM NIXL KV digest: a request silently reads another request's KV)", needs_pd=True,
          flags={"pd_early_release": True}),
    Fault("pd-recompute-offset", "pd_load, logits_decode",
          "with request 1's stored KV lost, the recompute after the failed load resumes at the offset the load "
          "was to reach instead of 0 and the load is logged as handled (vLLM #49250, "
          "kv_load_failure_policy=recompute)", needs_pd=True,
          flags={"pd_recompute_offset": True, "pd_lost_request": PD_LOST_REQUEST}),
    Fault("pd-unbounded-retry", "pd_load",
          "with request 1's stored KV lost, the failed load is retried without a bound while the request holds "
          "its blocks (rtp-llm loadCacheDone retried forever); the harness's deadline ends the wait",
          needs_pd=True,
          flags={"pd_unbounded_retry": True, "pd_lost_request": PD_LOST_REQUEST}),
    Fault("pd-error-under-lock", "hang",
          "with request 1's stored KV lost, the failed attempt is reported while the lock that reporting takes is "
          "held (rtp-llm reportError under output_mutex_): the rank deadlocks; the load's watchdog reports the hang "
          "with every thread's stack and ends the rank (an ERROR cell naming it), never a wait forever",
          needs_pd=True,
          flags={"pd_error_under_lock": True, "pd_lost_request": PD_LOST_REQUEST}),
    Fault("pd-decode-unloaded", "pd_load, pd_transfer",
          "with request 1's stored KV lost, the failed load is reported loaded and the decode computes on "
          "blocks that never loaded (LMCache #3388; rtp-llm decode on an errored stream)", needs_pd=True,
          flags={"pd_decode_unloaded": True, "pd_lost_request": PD_LOST_REQUEST}),
    Fault("pd-load-never-reads", "pd_load",
          "every KV load of the decode side fails on an undamaged store (its reads look the entries up under "
          "another key) and the prompt is silently recomputed: outputs right, P/D off", needs_pd=True,
          flags={"pd_never_reads": True}),
    Fault("pd-state-conv-shift", "pd_transfer, logits_decode",
          "a hybrid model's transferred conv state placed one token late on the decode side: the window's newest "
          "input dropped, its oldest slot zero (an off-by-one in the state's cut between prefill and decode); "
          "inert on a model without linear attention", needs_pd=True,
          flags={"pd_state_conv_shift": True}),
    Fault("pd-state-same-rank", "pd_transfer, logits_decode",
          "a hybrid model's linear-attention state read by decode rank r from prefill rank r, its i-th V (K) head "
          "slice from that rank's i-th, as if both sides split the V heads alike (the head slice taken from the "
          "wrong prefill rank under heterogeneous TP); inert where prefill rank r holds decode rank r's heads",
          needs_pd=True,
          flags={"pd_state_same_rank": True}, inert=_same_rank_inert),
)
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
