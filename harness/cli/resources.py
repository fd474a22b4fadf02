"""Resource limits checked before any work, from the planner's own numbers (each failure: one line, exit 2): every
cell's and the reference's KV / state cache groups against the run's budget and slot length, the reference's
weights against this machine's memory, and the peak activations of one prefill.

Activations. One process holding a 1/tp share of the attention heads and FFN columns (the reference: tp=1, all of them)
prefills one sequence of `tokens` tokens (T) in one forward. Per layer, live at once besides the weights and the
KV cache, as float32 (FLOAT32_BYTES; the embedded engine computes in float32 and the reference always does):

    residual   = 2 * T * hidden                                  the residual stream and the normed input
    attention  = T * (q + 2 * kv) * head_dim                     Q, K, V of the step
               + q * T * T                                       the scores (softmax probabilities) of the prompt
               + T * q * head_dim                                the heads' outputs
    ffn        = 3 * T * ffn_r                                   gate, up and their product
    logits     = T * vocab_r + T * vocab                         the rank's vocab shard and the gathered logits
    peak       = FLOAT32_BYTES * (residual + max(attention, ffn, logits))

with q = ceil(heads / tp), kv = max(1, ceil(kv_heads / tp)), ffn_r = ceil(ffn / tp), vocab_r = ceil(vocab / tp).
Layers run one after another, so the peak is one layer's (or the logits'), not a sum over layers. A MoE layer is
counted as the model's dense ffn width; MLA's latent and a hybrid's linear-attention state are not counted
separately (the KV/state check covers their caches). T is the run's --max-seq-len: the least any run of that
slot length prefills in a step (a whole prompt filling one slot); a batch of several such prompts in one step
needs a multiple, which this lower bound does not refuse."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from harness.arch.component import PlanError
from harness.arch.document import plan_sections
from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.core.errors import ConfigError
from harness.formats.names import expected_shapes
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings
from harness.specs.topology import Topology

GIB = 1024 ** 3
FLOAT32_BYTES = 4  # the embedded engine holds every weight as float32 (harness/formats/weights.py: load_weights)


def check_cache_budgets(models: Sequence[ModelSpec], topologies: Sequence[Topology], budget_bytes: int,
                        max_seq_len: int) -> None:
    """Each model's plan at each topology (the reference's included) holds at least one sequence slot of
    `max_seq_len` tokens in `budget_bytes` per rank, in every cache group (KV pages, indexer keys, recurrent state,
    the MTP head's pages), exactly as `harness plan --budget-gib` computes it. A cell whose layout does not split is
    left to its SKIP."""
    block_size = PoolSettings().block_size
    for model in models:
        for topo in topologies:
            try:
                plan = plan_model(model_of(model), topo)
            except PlanError:  # the cell is a SKIP saying why (flow/runner.skip_reason)
                continue
            try:
                plan_sections(plan, budget_bytes, max_seq_len, block_size)
            except PlanError:
                continue
            except ConfigError as exc:
                raise ConfigError(f"{model.name} at {topo.name}: {exc}; raise --kv-budget-mib or lower "
                                  f"--max-seq-len (harness plan --model {model.name} --topo {topo.name} "
                                  f"--budget-gib N --max-seq-len N shows the groups)") from None


def weight_bytes(model: ModelSpec) -> int:
    """Bytes of every weight of `model` as the embedded engine loads it (float32, unsharded)."""
    return sum(math.prod(shape) for shape in expected_shapes(model).values()) * FLOAT32_BYTES


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def require_weight_memory(models: Sequence[ModelSpec], memory: int | None = None) -> None:
    """The reference loads a model's every weight (float32) in one process: a model larger than this machine's
    memory is one error with the figure and the limit, not an ERROR cell after a failed allocation."""
    limit = machine_memory_bytes() if memory is None else memory
    for model in models:
        need = weight_bytes(model)
        if need > limit:
            raise ConfigError(f"model {model.name}: its weights take {need / GIB:.1f} GiB as float32 (the reference "
                              f"loads them whole); this machine has {limit / GIB:.1f} GiB of memory; check hidden, "
                              f"ffn, vocab and layers")


@dataclass(frozen=True)
class Activations:
    """Peak activation bytes of one process (rank) of `model` at tensor-parallel size `tp`, and its parts."""
    tp: int
    tokens: int
    residual: int
    attention: int
    ffn: int
    logits: int

    @property
    def peak(self) -> int:
        return FLOAT32_BYTES * (self.residual + max(self.attention, self.ffn, self.logits))

    def to_dict(self) -> dict[str, int]:
        return {"tokens": self.tokens, "peak_bytes_per_rank": self.peak, "ranks": self.tp,
                "peak_bytes_all_ranks": self.peak * self.tp,
                **{f"{part}_bytes": FLOAT32_BYTES * getattr(self, part)
                   for part in ("residual", "attention", "ffn", "logits")}}


def activations(model: ModelSpec, tp: int, tokens: int) -> Activations:
    """The peak activation memory of one rank of `model` at tensor-parallel size `tp` prefilling `tokens` tokens
    (the module's formula)."""
    q, kv = math.ceil(model.heads / tp), max(1, math.ceil(model.kv_heads / tp))
    t = tokens
    return Activations(tp=tp, tokens=t, residual=2 * t * model.hidden,
                       attention=t * (q + 2 * kv) * model.head_dim + q * t * t + t * q * model.head_dim,
                       ffn=3 * t * math.ceil(model.ffn / tp),
                       logits=t * math.ceil(model.vocab / tp) + t * model.vocab)


def require_activation_memory(models: Sequence[ModelSpec], topologies: Sequence[Topology], max_seq_len: int,
                              memory: int) -> None:
    """Every topology's processes (its tp ranks, all on this machine; the reference's and the cells') must hold
    the peak activations of one `max_seq_len`-token prefill in `memory` bytes: else one error naming the figure,
    its parts and the limit, not an ERROR cell after a failed allocation."""
    for model in models:
        for tp in sorted({t.tp for t in topologies}):
            act = activations(model, tp, max_seq_len)
            need = act.peak * tp
            if need > memory:
                who = "tp=1 (one process)" if tp == 1 else f"tp={tp} ({tp} ranks on this machine)"
                parts = ", ".join(f"{k.removesuffix('_bytes')} {v / GIB:.1f}"
                                  for k, v in act.to_dict().items() if k.endswith("_bytes") and "peak" not in k)
                raise ConfigError(
                    f"model {model.name}: {who} needs {need / GIB:.1f} GiB of activations for one {max_seq_len}-token "
                    f"prefill ({act.peak / GIB:.1f} GiB per rank: {parts} GiB; harness plan shows them); this "
                    f"machine has {memory / GIB:.1f} GiB of memory; lower --max-seq-len or check hidden, ffn, vocab "
                    f"and heads")
