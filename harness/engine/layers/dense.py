"""The decoder: RMSNorm, RoPE, GQA attention over a paged KV cache, SwiGLU MLP.

No distributed code here: the model holds one rank's shard of the weights (see parallelize.py) and
calls a Collectives object, whose operations are identities at world size 1. One attention path
serves prefill, extend and decode: new tokens' K/V are stored (only on their owner rank under DCP),
then the DCP group's Q heads attend to the tokens stored on this rank, and the group merges the
partial outputs with their log-sum-exp weights. With dcp = 1 the group is the rank itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from harness.engine.fault import FaultFlags
from harness.engine.layers.linear import Linear, matmul_t
from harness.engine.runtime.kvcache import PagedKVCache
from harness.engine.runtime.parallel import Collectives
from harness.partition.layout import ROUND_ROBIN, Placement, local_positions, token_owner
from harness.records.contract import COLLECTIVE_SITES

TORCH_REDUCE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FULL_PRECISION = (torch.float32, torch.float64)  # dtypes torch's norm kernels compute in their own precision


@dataclass
class LayerWeights:
    """One layer's local shard: Q rows of own heads, K/V rows of held KV heads, FFN columns of own shard."""

    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [hd]: per-head RMSNorm weight of q before RoPE (Qwen3-Next), None: none
    k_norm: torch.Tensor | None = None  # [hd]: the same for k


@dataclass
class LocalWeights:
    """One rank's weights. embed / lm_head: [vocab_rows, H], the rows of token ids
    [vocab_start, vocab_start + vocab_held) then zero padding (vocab-parallel; see layout.vocab_shard)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    vocab_start: int
    vocab_held: int
    vocab: int  # the model's whole vocabulary: the gathered logits are cut to it


@dataclass(frozen=True)
class HeadMap:
    """How this rank's attention reads its KV heads (indices into the KV heads it holds)."""

    n_q: int
    n_kv: int
    group_q_to_local_kv: tuple[int, ...]
    own_slice: tuple[int, int]


@dataclass(frozen=True)
class Hyper:
    head_dim: int
    rope_theta: float
    norm_eps: float


# Collective steps whose output is checked against an exact (float64) recomputation from its inputs
# during a captured forward, in the order a layer runs them (see Decoder._probe_site).


@dataclass
class Capture:
    """Per-layer tensors of one forward, for localization: residual stream, per-head attention output
    and, per collective site, this rank's error of the collective's output in unit roundoffs [B, S, sites]."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    attn: list[torch.Tensor] = field(default_factory=list)
    collectives: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Batch:
    """New tokens of several sequences, right-padded: ids/positions [B, S], valid [B, S]."""

    seq_ids: tuple[int, ...]
    ids: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in FULL_PRECISION:  # torch's kernel: the same operations in x's dtype (the same bits), one call
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    var = x.pow(2).mean(-1, keepdim=True)  # in x's dtype (torch's kernel would compute a half dtype in float32)
    return x * torch.rsqrt(var + eps) * weight


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, 1, hd] of rotate-half RoPE at `positions` [B, S]; computed once per forward."""
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=calc, device=positions.device) / head_dim))
    freqs = positions.to(calc)[..., None] * inv_freq  # [B, S, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, S, 1, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeCache:
    """cos/sin rows of rope_tables for positions 0..n-1, computed once (grown on demand) and gathered
    per forward; the same arithmetic as rope_tables, so the same values."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, S, 1, hd] at `positions` [B, S]."""
        key = (dtype, positions.device)
        cos, sin = self._tables.get(key, (None, None))
        need = int(positions.max()) + 1 if positions.numel() else 1
        if cos is None or sin is None or cos.shape[1] < need:
            size = max(need, 2 * cos.shape[1] if cos is not None else 256)
            every = torch.arange(size, device=positions.device)[None, :]  # [1, size]
            cos, sin = rope_tables(every, self.head_dim, self.theta, dtype)  # [1, size, 1, hd] each
            self._tables[key] = (cos, sin)
        # [1, size, 1, hd] -> rows at positions -> [B, S, 1, hd]
        return cos[0][positions], sin[0][positions]


def apply_rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [B, S, heads, hd] by precomputed rope_tables."""
    cos, sin = tables
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_qk(q: torch.Tensor, k: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
            k_tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope of q [B, S, Hq, hd] by `tables` and of k [B, S, Hkv, hd] by `k_tables`. Where both share
    the tables and are views of one row (a fused projection's output, q's heads then k's), one rotation
    of the joint [B, S, Hq + Hkv, hd] view: the same arithmetic on every element, half the kernels."""
    if k_tables is not tables or not _adjacent_heads(q, k):
        return apply_rope(q, tables), apply_rope(k, k_tables)
    qk = q.as_strided((*q.shape[:2], q.shape[2] + k.shape[2], q.shape[3]), q.stride())  # [B, S, Hq + Hkv, hd]
    return apply_rope(qk, tables).split([q.shape[2], k.shape[2]], dim=2)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when k's heads follow q's in memory, one head stride apart, with the same strides."""
    return (q.stride() == k.stride() and q.dtype == k.dtype and q.device == k.device and q.shape[3] == k.shape[3]
            and q.stride(3) == 1 and q.stride(2) == q.shape[3]
            and k.data_ptr() == q.data_ptr() + q.shape[2] * q.stride(2) * q.element_size())


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face Llama convention). x: [B, S, heads, hd], positions: [B, S]."""
    return apply_rope(x, rope_tables(positions, x.shape[-1], theta, x.dtype))


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    kv_index: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, S, Hq, hd] over k/v [B, L, Hkv, hd] with mask [B, S, L] (True = visible).

    Query head h reads KV head kv_index[h]. Returns (out [B, S, Hq, hd], lse [B, S, Hq]); a query with
    no visible key gets out = 0 and lse = -inf, so an LSE merge gives it no weight.
    """
    idx = torch.tensor(kv_index, device=k.device)
    k_sel, v_sel = k[:, :, idx], v[:, :, idx]  # [B, L, Hq, hd]
    scores = torch.einsum("bshd,blhd->bhsl", q, k_sel) / (q.shape[-1] ** 0.5)
    scores.masked_fill_(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, S]
    blind = ~mask.any(dim=-1)  # [B, S]: queries with no visible key (padding, or no token on this rank)
    probs = torch.softmax(scores, dim=-1).masked_fill(blind[:, None, :, None], 0.0)  # NaN elsewhere stays NaN
    out = torch.einsum("bhsl,blhd->bshd", probs, v_sel)
    return out, lse.transpose(1, 2)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fused CPU kernel's form of mask [B, S, L] (True = visible): [B, 1, S, L] of 0 or -inf in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       kv_index: tuple[int, ...], kind: str = "mask",
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """local_attention (same arguments and results) through torch's fused CPU kernel, which also returns
    the LSE; on other devices, local_attention itself. `kind` is mask_kind(mask) ("all": no mask);
    `bias` is additive_mask(mask, q.dtype) when the caller made it already (once for all layers)."""
    if q.device.type != "cpu":
        return local_attention(q, k, v, mask, kv_index)
    idx = torch.tensor(kv_index, device=k.device)
    # [B, L, Hkv, hd] -> per query head [B, L, Hq, hd] -> [B, Hq, L, hd]
    k_h, v_h = k[:, :, idx].transpose(1, 2), v[:, :, idx].transpose(1, 2)
    if kind == "all":
        bias = None
    elif bias is None:
        bias = additive_mask(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k_h, v_h, 0.0, False, attn_mask=bias)  # [B, Hq, S, hd], [B, Hq, S]
    out = out.transpose(1, 2)  # [B, S, Hq, hd]
    if kind == "all":
        return out, lse.transpose(1, 2).to(q.dtype)  # [B, S, Hq]
    blind = ~mask.any(dim=-1)  # [B, S]: no visible key: out 0 (as the kernel leaves it), lse -inf
    lse = lse.transpose(1, 2).to(q.dtype).masked_fill(blind[:, :, None], float("-inf"))  # [B, S, Hq], q's dtype
    return out.masked_fill(blind[:, :, None, None], 0.0), lse


def grouped_kv(kv_index: tuple[int, ...], n_kv: int) -> bool:
    """True when query head h reads KV head h // (Hq / Hkv): the standard GQA grouping, which the fused
    kernel handles without copying K/V per query head (enable_gqa)."""
    n_q = len(kv_index)
    return n_q % n_kv == 0 and kv_index == tuple(h // (n_q // n_kv) for h in range(n_q))


def mask_kind(visible: torch.Tensor, queries: torch.Tensor | None = None) -> str:
    """How the fused kernel can take `visible` [B, S, L]: "all" (every key visible to every query: no
    mask), "causal" (query s sees keys 0..s, S == L: the kernel's own causal mask) or "mask". With
    `queries` [B, S] (the batch's real tokens, True; padding False) only the real queries' rows must be
    causal: a right-padded first forward, whose padding queries' outputs nothing reads, is "causal" too."""
    if bool(visible.all()):
        return "all"
    S, L = visible.shape[1:]
    if S != L:
        return "mask"
    causal = torch.ones(S, L, dtype=torch.bool, device=visible.device).tril().expand_as(visible)
    if queries is None:
        return "causal" if torch.equal(visible, causal) else "mask"
    rows = queries[:, :, None]  # [B, S, 1]
    return "causal" if torch.equal(visible & rows, causal & rows) else "mask"


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    kv_index: tuple[int, ...], kind: str = "mask") -> torch.Tensor:
    """local_attention's output without the LSE (no merge needs it), through torch's fused kernel.
    `kind` is mask_kind(mask): "all" and "causal" let the kernel skip reading a mask."""
    # [B, S|L, H, hd] -> [B, H, S|L, hd] for scaled_dot_product_attention
    if grouped_kv(kv_index, k.shape[2]):
        k_h, v_h, gqa = k.transpose(1, 2), v.transpose(1, 2), k.shape[2] != len(kv_index)
    else:
        idx = torch.tensor(kv_index, device=k.device)
        k_h, v_h, gqa = k[:, :, idx].transpose(1, 2), v[:, :, idx].transpose(1, 2), False
    if kind != "mask":
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_h, v_h, is_causal=kind == "causal", enable_gqa=gqa)
        return out.transpose(1, 2)  # [B, S, Hq, hd]; every query sees at least one key
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_h, v_h, attn_mask=mask[:, None], enable_gqa=gqa)
    blind = ~mask.any(dim=-1)  # [B, S]: padding queries, whose rows the kernel fills with NaN
    return out.transpose(1, 2).masked_fill(blind[:, :, None, None], 0.0)  # [B, S, Hq, hd]


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """Merge DCP partials: outs [G, B, S, H, hd], lses [G, B, S, H] -> [B, S, H, hd].

    `mean` is the dcp-lse-merge fault: an unweighted average of the partial outputs.
    """
    if mean:
        return outs.mean(dim=0)
    top = lses.max(dim=0).values
    weights = torch.exp(lses - torch.where(torch.isinf(top), torch.zeros_like(top), top))  # [G, B, S, H]
    total = weights.sum(dim=0).clamp_min(torch.finfo(outs.dtype).tiny)
    return (weights[..., None] * outs).sum(dim=0) / total[..., None]


def partial_lse(lse: torch.Tensor, flags: FaultFlags) -> torch.Tensor:
    """A DCP partial's LSE [B, S, H] as the merge receives it: natural log, -inf where the rank saw no
    key. Hooks: `lse_base2` (a fault) hands over log2 of the sum (a base-2 kernel's LSE to the natural-log
    merge); `empty_lse_zero` (a fault) reports 0 instead of -inf for a shard with no visible key."""
    if flags.lse_base2:
        lse = lse / math.log(2.0)
    if flags.empty_lse_zero:
        lse = lse.masked_fill(torch.isinf(lse), 0.0)
    return lse


def split_key_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        kv_index: tuple[int, ...], parts: int,
                        attend: Callable[..., tuple[torch.Tensor, torch.Tensor]] = local_attention) -> torch.Tensor:
    """The noise perturbation of attention: keys dealt round-robin into `parts` sets (as DCP deals
    tokens to ranks), attended separately by `attend` (local_attention's arguments and results: the DCP path's
    attention_with_lse where the values have the keys' head size) and LSE-merged; mathematically equal to
    local_attention."""
    keys_all = torch.arange(mask.shape[-1], device=mask.device)  # [L]
    # [~L / parts] each; a set that would be empty (L <= p) is left out: it would add nothing to the merge (its
    # LSE -inf), and a fused kernel cannot take zero keys
    sets = [keys_all[p::parts] for p in range(min(parts, mask.shape[-1]))]
    outs, lses = zip(*(attend(q, k[:, keys], v[:, keys], mask[:, :, keys], kv_index) for keys in sets))
    return merge_partials(torch.stack(outs), torch.stack(lses))  # [B, S, Hq, hd]


class Decoder:
    """One rank's view of the model: forward over new tokens of a batch, through the paged KV cache."""

    def __init__(self, weights: LocalWeights, heads: HeadMap, hyper: Hyper, comm: Collectives,
                 cache: PagedKVCache, flags: FaultFlags, placement: Placement = ROUND_ROBIN,
                 fuse: bool = True) -> None:
        self.placement = placement
        self.w = weights
        self.heads = heads
        self.hyper = hyper
        self.comm = comm
        self.cache = cache
        self.flags = flags
        self._sites: dict[str, torch.Tensor] | None = None  # collective errors of the layer being captured
        self._rope = RopeCache(hyper.head_dim, hyper.rope_theta)
        self._fused = [fuse_projections(layer) for layer in weights.layers] if fuse else []
        self._mats = [LayerLinears.of(f, layer) for f, layer in zip(self._fused, weights.layers)]
        self._lm_head = Linear(weights.lm_head)
        self._fresh = False  # this forward's keys are its new tokens (_fresh_prefill)

    def forward(self, batch: Batch, capture: Capture | None = None) -> torch.Tensor:
        """Logits [B, S, V] for every new token; stores the new tokens' K/V first."""
        return self.logits(self.hidden(batch, capture))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and column-parallel lm_head of last-layer residual states x [B, S, H] -> [B, S, V]:
        each rank's [B, S, vocab_rows] shard, all-gathered over TP, with the padding cut."""
        local = self._lm_head(rms_norm(x, self.w.norm, self.hyper.norm_eps))  # [B, S, vocab_rows]
        return self.comm.gather_tp(local, dim=-1)[..., : self.w.vocab]  # [B, S, tp * vocab_rows] -> [B, S, V]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding of ids [B, S] -> [B, S, H]: each rank looks up the ids of its shard
        (zero for the others), and the TP all-reduce sums the one non-zero row per token."""
        if self.comm.tp == 1 and self.w.vocab_start == 0 and int(ids.max()) < self.w.vocab_held:
            return self.w.embed[ids]  # the whole table here and every id in it: the rows themselves
        local = ids - self.w.vocab_start  # [B, S]
        held = (local >= 0) & (local < self.w.vocab_held)
        rows = self.w.embed[local.clamp(0, self.w.embed.shape[0] - 1)]  # [B, S, H]
        return self.comm.reduce_tp(rows.masked_fill(~held[..., None], 0.0))

    def hidden(self, batch: Batch, capture: Capture | None = None,
               embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after the last layer (before the final norm), [B, S, H], for every new
        token; stores the new tokens' K/V first. `embeds` [B, S, H] replaces the token embeddings as
        the first layer's input (an MTP module feeds its projected [hidden; embedding] this way)."""
        slots, stored_mask = self._reserve(batch)
        write_rows = self.cache.rows(slots)  # [n]: flattened pool rows of the new tokens stored here
        rows, key_pos, key_valid = self._key_index(batch)
        flat = rows.flatten()  # [B, L] -> [B * L]: rows of the flattened pool to read
        # visible[b, s, l]: key l is stored and not after query s
        visible = key_valid[:, None, :] & (key_pos[:, None, :] <= batch.positions[:, :, None])
        x = self.embed(batch.ids) if embeds is None else embeds  # [B, S, H]
        tables = self._rope.tables(batch.positions, x.dtype)
        k_tables = tables
        if self.flags.rope_local_positions and self.comm.dcp > 1:  # the dcp-rope-local-pos fault: keys rotated
            k_tables = self._rope.tables(batch.positions // self.comm.dcp, x.dtype)  # by their local store index
        kind = mask_kind(visible, batch.valid if self.comm.dcp == 1 else None)  # the DCP path merges every row
        # the DCP path's fused-kernel mask, made once for every layer: [B, 1, S, L]
        bias = (additive_mask(visible, x.dtype) if self.comm.dcp > 1 and kind == "mask" and x.device.type == "cpu"
                else None)
        self._fresh = self._fresh_prefill(batch, stored_mask)
        if capture is not None:
            capture.hidden.append(x)
        for i, layer in enumerate(self.w.layers):
            self._sites = {} if capture is not None else None
            attn = self._attention(i, layer, rms_norm(x, layer.attn_norm, self.hyper.norm_eps), batch,
                                   write_rows, stored_mask, flat, (visible, kind, bias), tables, k_tables)
            if capture is not None:
                capture.attn.append(attn)
            x = x + self._row_parallel(attn.flatten(2), layer.o, attn_out=True, linear=self._mats[i].o)
            x = x + self._mlp(i, layer, rms_norm(x, layer.mlp_norm, self.hyper.norm_eps))
            self._capture_layer(capture, x)
        self._sites = None
        self._fresh = False
        return x

    def _fresh_prefill(self, batch: Batch, stored: torch.Tensor) -> bool:
        """True when the keys each sequence attends to in this forward are exactly its new tokens, stored in
        batch order (a first forward of every sequence at DCP 1: nothing stored before, every valid token
        stored here): the new K/V [B, S, Hkv, hd] then equal what reading them back from the pool gives at
        every visible key, so attention can take them as they are (the padded keys differ, and are masked).
        Off under a fault that changes what the pool's rows hold or where they are read."""
        if self.comm.dcp != 1 or self.flags.block_table_width or not torch.equal(stored, batch.valid):
            return False
        counts = batch.valid.sum(dim=1).tolist()
        return all(len(self.cache.seqs[s].positions) == n for s, n in zip(batch.seq_ids, counts))

    def _mlp(self, i: int, layer: Any, h: torch.Tensor) -> torch.Tensor:
        """Layer i's FFN of its normed input h [B, S, H], summed over the TP group -> [B, S, H]."""
        gate, up = self._mats[i].gate_up(h).split(layer.gate.shape[0], dim=-1)  # [B, S, 2F] -> 2 x [B, S, F]
        return self._row_parallel(F.silu(gate) * up, layer.down, linear=self._mats[i].down)

    def _capture_layer(self, capture: Capture | None, x: torch.Tensor) -> None:
        """Record a layer's output residual stream [B, S, H] and its collectives' errors [B, S, sites]."""
        if capture is None:
            return
        capture.hidden.append(x)
        zero = torch.zeros(x.shape[:2], dtype=torch.float64, device=x.device)
        sites = self._sites or {}
        capture.collectives.append(torch.stack([sites.get(n, zero) for n in COLLECTIVE_SITES], dim=-1))

    def _probe_site(self, name: str, got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Record collective site `name`'s error [B, S] in unit roundoffs u of got's dtype (contract.COLLECTIVES).
        With `scale` (a sum's |inputs| summed, [B, S, *]): max over elements of |got - exact| / (u x scale),
        which a correct sum of n inputs in got's dtype keeps <= n - 1 whatever its order (a rounding per
        addition), so cancellation cannot inflate it. Without: the normwise |got - exact| / (u x |exact|)."""
        if self._sites is None:
            return
        unit = torch.finfo(got.dtype).eps / 2
        diff = (got.to(torch.float64) - exact.to(torch.float64)).flatten(2)  # [B, S, *] -> [B, S, n]
        if scale is not None:
            err = (diff.abs() / (unit * scale.flatten(2)).clamp_min(torch.finfo(torch.float64).tiny)).amax(dim=-1)
        else:
            err = diff.norm(dim=-1) / (unit * exact.to(torch.float64).flatten(2).norm(dim=-1)).clamp_min(1e-300)
        self._sites[name] = torch.nan_to_num(err, nan=float("inf"))

    def _row_parallel(self, x: torch.Tensor, w: torch.Tensor, attn_out: bool = False,
                      linear: Linear | None = None) -> torch.Tensor:
        """x [B, S, K_local] @ w.T [K_local, H], summed over the TP group -> [B, S, H]; `linear` is w's
        Linear where the caller has one.

        Hooks (harness/engine/faults.py): `split_reduction` (the noise perturbation) computes the
        contraction as that many partial sums in the model dtype, added last-first, as a TP split would;
        `reduce_dtype` (a fault) does the all-reduce in a lower precision."""
        n = self.flags.split_reduction
        if n > 1 and x.shape[-1] >= n:
            parts = [matmul_t(xc, wc) for xc, wc in zip(x.chunk(n, dim=-1), w.chunk(n, dim=-1))]  # each [B, S, H]
            y = parts[-1]
            for part in reversed(parts[:-1]):
                y = y + part
        else:
            y = linear(x) if linear is not None else matmul_t(x, w)
        # every rank's partial, taken before the (in-place) all-reduce, when captured: [tp, B, S, H]
        parts64 = self.comm.gather_tp(y.unsqueeze(0), dim=0).to(torch.float64) if self._sites is not None else None
        if self.flags.reduce_dtype is not None and (attn_out or not self.flags.reduce_attn_only):
            low = TORCH_REDUCE_DTYPES[self.flags.reduce_dtype]
            out = self.comm.reduce_tp(y.to(low)).to(y.dtype)
        else:
            out = self.comm.reduce_tp(y)
        if parts64 is not None:  # the exact sum, and the sum of |partials| its rounding error scales with
            self._probe_site("attn-allreduce" if attn_out else "mlp-allreduce", out, parts64.sum(dim=0),
                             parts64.abs().sum(dim=0))
        return out

    def _record_prompt_lens(self, batch: Batch) -> list[int]:
        """Record each sequence's first-forward length on its first forward; returns the batch's valid counts."""
        counts: list[int] = batch.valid.sum(dim=1).tolist()
        for seq_id, n in zip(batch.seq_ids, counts):
            state = self.cache.seqs[seq_id]
            if state.prompt_len == 0 and not state.positions:
                state.prompt_len = n
        return counts

    def _prompt_lens(self, batch: Batch) -> torch.Tensor:
        """Each sequence's first-forward length [B, 1] (recorded on its first forward), which the
        contiguous placement deals; the dcp-contiguous-global-len fault deals by the whole batch's tokens."""
        counts = self._record_prompt_lens(batch)
        lens = [sum(counts) if self.flags.contiguous_global_len else self.cache.seqs[s].prompt_len
                for s in batch.seq_ids]
        return torch.tensor(lens, device=batch.positions.device)[:, None]

    def _reserve(self, batch: Batch) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """Cache slots for the new tokens this rank stores: all under TP; under DCP the tokens the
        placement gives it (layout.token_owner), or every token under the dcp-token-owner fault (decode
        steps only); the dcp-interleave-per-token fault deals an interleaved placement token by token."""
        dcp, me = self.comm.dcp, self.comm.dcp_rank
        decode_step = batch.ids.shape[1] == 1
        store_all = self.flags.store_on_all_dcp_ranks and decode_step
        valid = batch.valid | (self.flags.store_padding and dcp > 1)  # the dcp-store-padding fault
        if dcp == 1:  # one owner of every token
            self._record_prompt_lens(batch)
            stored = valid
        else:
            placement = ROUND_ROBIN if self.flags.interleave_per_token else self.placement
            owner = token_owner(batch.positions, dcp, placement, self._prompt_lens(batch))  # [B, S]
            stored = valid & ((owner == me) | store_all)  # [B, S]
        slots: list[tuple[int, int]] = []
        for seq_id, row, keep in zip(batch.seq_ids, batch.positions.tolist(), stored.tolist()):
            slots += self.cache.reserve(seq_id, [p for p, k in zip(row, keep) if k])
        return slots, stored

    def _local_positions(self, batch: Batch) -> list[list[int]]:
        """Per sequence, the positions this rank reads as its stored tokens, in storage order: under DCP
        the placement's share of the sequence so far (layout.local_positions, as an engine's local
        sequence lengths come from the placement rule), the cache's own record otherwise. A store that
        keeps more than its share (the dcp-token-owner and dcp-store-padding faults) reads what it
        stored, as such an engine does: the extra rows are counted by the merge, not misread."""
        states = [self.cache.seqs[s] for s in batch.seq_ids]
        if self.comm.dcp == 1 or self.flags.store_on_all_dcp_ranks or self.flags.store_padding:
            return [st.positions for st in states]
        ends = (batch.positions.masked_fill(~batch.valid, -1).amax(dim=1) + 1).tolist()  # [B]
        return [local_positions(max(end, st.positions[-1] + 1 if st.positions else 0), self.comm.dcp_rank,
                                self.comm.dcp, self.placement, st.prompt_len) for st, end in zip(states, ends)]

    def _key_index(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded (pool row, position, valid) of every token this rank reads for each sequence: [B, L]
        each; storage slot j holds the j-th of _local_positions, at row block * block_size + offset of
        the flattened pool. Built with one tensor per field."""
        states = [self.cache.seqs[s] for s in batch.seq_ids]
        local = self._local_positions(batch)
        length = max(1, max(len(p) for p in local))
        bs = self.cache.block_size
        n_blocks = -(-length // bs)
        stored = torch.tensor([len(p) for p in local])  # [B]
        table = torch.tensor([(st.blocks + [0] * n_blocks)[:n_blocks] for st in states],
                             dtype=torch.long).view(len(states), n_blocks)  # [B, n_blocks]
        j = torch.arange(length)  # storage index
        valid = j[None, :] < stored[:, None]  # [B, L]
        if self.comm.dcp == 1 and all(st.dense for st in states):  # every slot j holds position j
            pos = j.expand(len(states), length).masked_fill(~valid, 0)  # [B, L], as the lists padded with 0
        else:
            pos = torch.tensor([p + [0] * (length - len(p)) for p in local],
                               dtype=torch.long).view(len(states), length)  # [B, L]
        entry = j // bs if not self.flags.block_table_width else (j // bs) % self.flags.block_table_width
        rows = table[:, entry] * bs + j % bs  # [B, L]; entry wraps under the block-table-wrap fault
        dev = self.cache.k[0].device
        return rows.to(dev), pos.to(dev), valid.to(dev)

    def _attention(self, i: int, layer: LayerWeights, h: torch.Tensor, batch: Batch,
                   write_rows: torch.Tensor, stored: torch.Tensor, flat: torch.Tensor,
                   mask: tuple[torch.Tensor, str, torch.Tensor | None], tables: tuple[torch.Tensor, torch.Tensor],
                   k_tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention output of this rank's own Q heads: [B, S, n_q, hd]. `mask` is (visible [B, S, L],
        its mask_kind, its additive form or None); `k_tables` are the keys' RoPE tables (the queries'
        `tables` in a correct engine)."""
        B, S, _ = h.shape
        hd, hm = self.hyper.head_dim, self.heads
        visible, kind, bias = mask
        fused = self._fused[i]
        # [B, S, (Hq + 2 Hkv) * hd] -> q, k, v
        q, k, v = _proj(h, self._mats[i].qkv, fused.qkv_bias).split([hm.n_q * hd, hm.n_kv * hd, hm.n_kv * hd], dim=-1)
        q = q.reshape(B, S, hm.n_q, hd)  # [B, S, Hq_local, hd]
        k = k.reshape(B, S, hm.n_kv, hd)  # [B, S, Hkv_local, hd]
        v = v.reshape(B, S, hm.n_kv, hd)
        if layer.q_norm is not None and layer.k_norm is not None:  # per-head RMSNorm over hd
            q, k = rms_norm(q, layer.q_norm, self.hyper.norm_eps), rms_norm(k, layer.k_norm, self.hyper.norm_eps)
        q, k = rope_qk(q, k, tables, k_tables)
        if bool(stored.all()):  # every new token stored here: [B, S, Hkv, hd] -> [B * S, Hkv, hd] in row order
            self.cache.write_rows(i, write_rows, k.flatten(0, 1), v.flatten(0, 1))
        else:
            self.cache.write_rows(i, write_rows, k[stored], v[stored])
        if self._fresh:  # the keys are the new tokens: attend to them as they are, [B, S, Hkv_local, hd]
            k_all, v_all = k, v
        else:  # pool [blocks, block, Hkv, hd] -> [blocks * block, Hkv, hd] -> rows `flat` -> [B, L, Hkv_local, hd]
            k_all = self.cache.k[i].flatten(0, 1).index_select(0, flat).view(B, -1, hm.n_kv, hd)
            v_all = self.cache.v[i].flatten(0, 1).index_select(0, flat).view(B, -1, hm.n_kv, hd)
        if self.comm.dcp == 1 and self.flags.split_reduction > 1:
            return split_key_attention(q, k_all, v_all, visible, hm.group_q_to_local_kv, self.flags.split_reduction,
                                       attention_with_lse)
        if self.comm.dcp == 1:
            return fused_attention(q, k_all, v_all, visible, hm.group_q_to_local_kv, kind)
        group_q = self.comm.gather_dcp(q, dim=2)  # [B, S, dcp * Hq_local, hd], member order
        out, lse = attention_with_lse(group_q, k_all, v_all, visible, hm.group_q_to_local_kv, kind, bias)
        lse = partial_lse(lse, self.flags)
        if self.flags.empty_shard_nan:  # the dcp-empty-shard-nan fault: a sequence this rank holds no token of
            out = out.masked_fill(~visible.flatten(1).any(dim=-1)[:, None, None, None], float("nan"))
        # one gather for both, in float32 so a half-precision model's LSE keeps its precision:
        # [B, S, Hg, hd] + [B, S, Hg, 1] -> [dcp, B, S, Hg, hd + 1]
        #   -> this rank's own heads [dcp, B, S, Hq_local, hd + 1]
        lo, hi = hm.own_slice
        packed = self.comm.stack_dcp(torch.cat((out.float(), lse[..., None].float()), dim=-1))[:, :, :, lo:hi]
        outs, lses = packed[..., :-1].to(out.dtype), packed[..., -1].to(lse.dtype)  # [G, B, S, H, hd], [G, B, S, H]
        merged = merge_partials(outs, lses, self.flags.lse_merge_mean)  # [B, S, Hq_local, hd]
        if self._sites is not None:  # the gather must return this rank's own Q in its slot; the merge
            self._probe_site("dcp-q-gather", group_q[:, :, lo:hi], q)  # must equal an exact recompute
            self._probe_site("dcp-lse-merge", merged, merge_partials(outs.to(torch.float64), lses.to(torch.float64)))
        return merged


@dataclass(frozen=True)
class FusedProjections:
    """One layer's Q/K/V rows in one matrix (and biases) and gate/up rows in another, so each is one
    matmul; the layer's q/k/v/gate/up become views into them (no second copy of the weights)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor


def fuse_projections(layer: LayerWeights) -> FusedProjections:
    """Concatenate a layer's column-parallel projections and rebind its fields to views of the result."""
    qkv = torch.cat((layer.q, layer.k, layer.v))  # [(Hq + 2 Hkv) * hd, H]
    layer.q, layer.k, layer.v = qkv.split([layer.q.shape[0], layer.k.shape[0], layer.v.shape[0]])
    qkv_bias = None
    if any(b is not None for b in (layer.q_bias, layer.k_bias, layer.v_bias)):  # a missing one adds zeros
        parts = [b if b is not None else w.new_zeros(w.shape[0])
                 for b, w in ((layer.q_bias, layer.q), (layer.k_bias, layer.k), (layer.v_bias, layer.v))]
        qkv_bias = torch.cat(parts)  # [(Hq + 2 Hkv) * hd]
        layer.q_bias, layer.k_bias, layer.v_bias = qkv_bias.split([p.shape[0] for p in parts])
    gate_up = torch.cat((layer.gate, layer.up))  # [2 * ffn_local, H]
    layer.gate, layer.up = gate_up.split([layer.gate.shape[0], layer.up.shape[0]])
    return FusedProjections(qkv, qkv_bias, gate_up)


@dataclass(frozen=True)
class LayerLinears:
    """One layer's Linear of each projection matrix (the fused Q/K/V and gate/up, the output and down)."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear

    @classmethod
    def of(cls, fused: FusedProjections, layer: LayerWeights) -> "LayerLinears":
        return cls(Linear(fused.qkv), Linear(layer.o), Linear(fused.gate_up), Linear(layer.down))


def _proj(x: torch.Tensor, w: Linear, b: torch.Tensor | None) -> torch.Tensor:
    y = w(x)
    return y + b if b is not None else y
