"""Faults in attention data parallel around the MoE and redundant experts (dp_moe.py): each reproduces one real bug of
this code behind a flag (harness/engine/fault.py); the catalog (harness/engine/faults.py) gathers them."""

from __future__ import annotations

from harness.engine.fault import Fault

FAULTS: tuple[Fault, ...] = (
    Fault("dp-pad-local-count", "logits, generation",
          "under attention DP the gathered MoE buffer masked with this rank's local token count instead of each "
          "DP rank's own count within the padded (global) batch: tokens of DP ranks with more tokens lose this "
          "rank's expert outputs (SGLang #40643: GSM8K 0.14-0.26 vs 0.55); only with unequal DP batches",
          needs_tp=True,
          flags={"dp_pad_local_count": True}),
    Fault("dp-dummy-topk-wrap", "logits, generation",
          "an idle DP rank's dummy token, routed with top-k id -1, read as the last expert (the -1 wraps) and "
          "its output combined at index -1 of the real tokens: added to the last real token (vLLM #57787); "
          "only in steps with an idle DP rank", needs_tp=True,
          flags={"dp_dummy_wrap": True}),
    Fault("redundant-expert-twice", "logits, generation",
          "with redundant experts each rank picks the replica it holds itself instead of the one the shared "
          "rule picks, so an expert replicated on two EP ranks is computed and summed twice (SGLang #32962: "
          "GSM8K 0.63 -> 0.42); inert without replicas (redundant_experts=0 happens to be correct)",
          needs_tp=True,
          flags={"replica_local_first": True}),
    Fault("dp-shared-unreduced", "logits, generation",
          "under attention DP the shared expert's column-parallel partial sum added to the DP rank's own tokens "
          "without the all-reduce over the world: each token gets one rank's share of the shared expert "
          "(tpu-inference #3435)", needs_tp=True,
          flags={"dp_shared_unreduced": True}),
)
