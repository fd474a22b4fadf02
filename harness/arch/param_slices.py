"""The slice of every checkpoint tensor each rank should hold, from the layout plans.

One rule per sharding pattern, matched on the tensor's canonical name (harness/formats/names.py) without its
`layers.<i>.` prefix; a tensor no rule names is replicated (every rank holds all of it), so a new tensor that
an engine splits shows as a rank holding less than planned until a rule says how it splits. Rules:

- vocab-parallel: embed / lm_head rows of the rank's vocab shard;
- column-parallel by head: Q rows (q, q_b: the heads whose Q weights the rank holds; a gated Q's gate rows
  sit in each head's block), K/V rows and biases of its KV heads;
- row-parallel by head: the attention output projection's columns of its own Q heads;
- MLA kv_b: each head's first qk_nope rows (w_kc) for its Q-weight heads, its last v rows (w_vc) for its
  own heads (v = the output projection's columns per head);
- column / row-parallel FFN: gate / up rows and down columns of its FFN shard;
- linear attention: packed q|k|v in_proj and conv rows per component, z rows / b, a, A_log, dt_bias of its
  V heads, out-projection columns of the V heads whose output it adds;
- MoE: its experts (axis 0) with their column shard, the shared expert's column shard;
- sparse-attention indexer: Q rows (index_q) and head weights (index_w) of its index heads, the key
  projection (index_k) whole.

A slice is per axis a tuple of [lo, hi) index ranges (sorted, merged).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from harness.partition.hybrid_layout import HybridPlan, MoePlan, MoeRank
from harness.partition.layout import LayoutPlan
from harness.partition.mla_layout import q_weight_heads
from harness.partition.sparse_layout import SparsePlan

Ranges = tuple[tuple[int, int], ...]
Slice = tuple[Ranges, ...]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def ranges_of(indices: Iterable[int]) -> Ranges:
    """Sorted, merged [lo, hi) ranges of a set of indices."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):  # noqa: C414
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((lo, hi) for lo, hi in out)


def ranges_size(ranges: Ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)


def slice_size(s: Slice) -> int:
    size = 1
    for axis in s:
        size *= ranges_size(axis)
    return size


def _blocks(ids: Iterable[int], per: int, lo: int = 0, hi: int | None = None) -> list[int]:
    """Indices of rows [lo, hi) of each block `i` of `per` rows, for the given block ids."""
    top = per if hi is None else hi
    return [i * per + j for i in ids for j in range(lo, top)]


def _whole(shape: tuple[int, ...]) -> Slice:
    return tuple(((0, n),) if n else () for n in shape)


def _axis(shape: tuple[int, ...], axis: int, indices: Iterable[int]) -> Slice:
    """All of every axis but `axis`, which holds `indices`."""
    whole = list(_whole(shape))
    whole[axis] = ranges_of(indices)
    return tuple(whole)


def planned_slice(name: str, shapes: Mapping[str, tuple[int, ...]], rank: int, plan: LayoutPlan,
                  hybrid: HybridPlan | None = None, indexer: SparsePlan | None = None,
                  moe: MoePlan | None = None) -> Slice:
    """The slice of checkpoint tensor `name` (full shape shapes[name]) that `rank` should hold under `plan`
    (the full-attention layout) and, for a hybrid model, `hybrid` (linear attention and MoE), for sparse
    attention `indexer` (the indexer's heads), for an MLA model with experts `moe`."""
    shape = shapes[name]
    match = _LAYER.match(name)
    local = match.group(2) if match else name
    prefix = f"layers.{match.group(1)}." if match else ""
    r = plan.ranks[rank]
    heads, kv_heads = plan.shape.heads, plan.shape.kv_heads
    if local in ("embed.weight", "lm_head.weight"):
        return _axis(shape, 0, range(*r.vocab_shard))
    if local in ("q.weight", "q.bias", "q_b.weight"):
        return _axis(shape, 0, _blocks(q_weight_heads(r, plan.q_replicated), shape[0] // heads))
    if local in ("k.weight", "k.bias", "v.weight", "v.bias"):
        return _axis(shape, 0, _blocks(r.kv_heads, shape[0] // kv_heads))
    if local == "o.weight":
        return _axis(shape, 1, _blocks(r.q_heads, shape[1] // heads))
    if local == "kv_b.weight":
        per = shape[0] // heads
        nope = per - shapes[prefix + "o.weight"][1] // heads
        rows = _blocks(q_weight_heads(r, plan.q_replicated), per, 0, nope) + _blocks(r.q_heads, per, nope)
        return _axis(shape, 0, rows)
    if local in ("gate.weight", "up.weight"):
        return _axis(shape, 0, range(*r.ffn_shard))
    if local == "down.weight":
        return _axis(shape, 1, range(*r.ffn_shard))
    if indexer is not None and local in ("index_q.weight", "index_w.weight"):
        own = indexer.ranks[rank].index_heads
        return _axis(shape, 0, _blocks(own, shape[0] // indexer.shape.index_heads))
    if hybrid is not None:
        found = _hybrid_slice(local, shape, rank, hybrid)
        if found is not None:
            return found
    if moe is not None:
        found = _moe_slice(local, shape, moe.ranks[rank])
        if found is not None:
            return found
    return _whole(shape)


def _hybrid_slice(local: str, shape: tuple[int, ...], rank: int, hybrid: HybridPlan) -> Slice | None:
    lin = hybrid.linear.ranks[rank]
    n_v = len(hybrid.linear.v_replicas)
    if local in ("lin_qkv.weight", "lin_conv.weight"):
        return _axis(shape, 0, [i for lo, hi in lin.conv_rows for i in range(lo, hi)])
    if local in ("lin_z.weight", "lin_b.weight", "lin_a.weight", "lin_A_log", "lin_dt_bias"):
        return _axis(shape, 0, _blocks(lin.v_heads, shape[0] // n_v))
    if local == "lin_out.weight":
        return _axis(shape, 1, _blocks(lin.out_v_heads, shape[1] // n_v))
    if hybrid.moe is None:
        return None
    return _moe_slice(local, shape, hybrid.moe.ranks[rank])


def _moe_slice(local: str, shape: tuple[int, ...], moe: MoeRank) -> Slice | None:
    held = moe.logical or moe.experts  # the checkpoint's (logical) experts behind its physical slots
    if local in ("experts.gate.weight", "experts.up.weight"):
        s = list(_axis(shape, 0, held))
        s[1] = ranges_of(range(*moe.expert_ffn_shard))
        return tuple(s)
    if local == "experts.down.weight":
        s = list(_axis(shape, 0, held))
        s[2] = ranges_of(range(*moe.expert_ffn_shard))
        return tuple(s)
    if local in ("shared.gate.weight", "shared.up.weight"):
        return _axis(shape, 0, range(*moe.shared_ffn_shard))
    if local == "shared.down.weight":
        return _axis(shape, 1, range(*moe.shared_ffn_shard))
    return None


# what each checkpoint tensor computes, for localization: the sub-block a wrong shard of it breaks
_SUB_BLOCKS: tuple[tuple[str, str], ...] = (
    ("o.weight", "attention output projection"), ("lin_out.weight", "linear-attention output projection"),
    ("attn_norm.weight", "attention input norm"), ("mlp_norm.weight", "MLP input norm"),
    ("index_", "sparse-attention indexer"), ("router.weight", "MoE router"), ("shared.", "MoE shared expert"),
    ("experts.", "MoE routed experts"),
    ("gate.weight", "MLP"), ("up.weight", "MLP"), ("down.weight", "MLP"), ("lin_", "linear attention"),
    ("q_a", "attention Q projection"), ("q.", "attention Q projection"), ("q_b.", "attention Q projection"),
    ("kv_a", "attention latent projection"), ("kv_b.", "attention latent projection"),
    ("k.", "attention K/V projection"), ("v.", "attention K/V projection"),
)


def sub_block(name: str) -> tuple[int | None, str]:
    """(layer or None, the sub-block) of checkpoint tensor `name`: e.g. (0, 'attention output projection');
    the embedding, and the final norm and lm_head as the output head, outside the layers."""
    match = _LAYER.match(name)
    if match is None:
        return None, "embedding" if name.startswith("embed.") else "output head"
    local = match.group(2)
    label = next((label for key, label in _SUB_BLOCKS if local.startswith(key)), local)
    return int(match.group(1)), label
