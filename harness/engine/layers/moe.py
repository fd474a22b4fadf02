"""Mixture-of-experts FFN with a shared expert, one rank's experts, no distributed code.

Every rank holds all tokens (the residual stream is replicated under TP), computes the router (its
weights replicated) for all of them, runs its own experts' column shards on the tokens routed to
them (a mask: weight 0 for the others) and its shard of the shared expert; the caller sums the
partials over the TP world with one all-reduce. This is the all-gather + mask form of expert
parallel (tokens need no gather here, they are already on every rank), not all-to-all dispatch.

Routing: softmax over all experts in float32, top-k, the k weights renormalized to sum to 1 (DeepSeek-V2's
norm_topk_prob; without it, MoeWeights.renormalize False, each weight stays its probability). With
redundant experts (harness/partition/expert_map.py) a token routed to logical expert l goes to the one
physical replica the map picks for its index in the MoE batch; a rank runs its physical slots.

Under attention data parallel the caller hands the gathered, padded rows of every DP rank
(harness/engine/layers/dp_moe.py): `real` marks the rows routed to experts, `dummy` an idle DP rank's dummy token
(top-k id -1: routed nowhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.partition.expert_map import ExpertMap, local_first_pick


@dataclass
class MoeWeights:
    """One MoE layer's local shard: experts `expert_ids` (global), each with its etp column shard, and
    the shared expert's column shard; `down` holds every down projection side by side, so the layer's
    output is one row-parallel contraction of the concatenated activations."""

    router: torch.Tensor  # [E, H], replicated
    gate: torch.Tensor  # [E_local, F_local, H]
    up: torch.Tensor  # [E_local, F_local, H]
    shared_gate: torch.Tensor | None  # [Fs_local, H]
    shared_up: torch.Tensor | None  # [Fs_local, H]
    down: torch.Tensor  # [H, E_local * F_local + Fs_local]: experts in order, then the shared expert
    expert_ids: tuple[int, ...]  # physical slots (= logical experts without replicas)
    expert_map: ExpertMap | None = None  # None: no replicas
    loaded: tuple[int, ...] = ()  # the logical expert whose weights each local slot holds
    renormalize: bool = True  # the top-k weights rescaled to sum to 1 (MoeShape.renormalize)


@dataclass(frozen=True)
class MoeRows:
    """Which rows of an MoE batch [N] are real tokens (`real`) and which an idle DP rank's dummy token
    (`dummy`, top-k id -1); the rest are padding. `dummy_wrap` and `local_first` are faults
    (dp-dummy-topk-wrap: a -1 id read as the last expert; redundant-expert-twice)."""

    real: torch.Tensor  # [N] bool
    dummy: torch.Tensor  # [N] bool
    dummy_wrap: bool = False
    local_first: bool = False

    @classmethod
    def all_real(cls, n: int, device: torch.device, local_first: bool = False) -> "MoeRows":
        return cls(torch.ones(n, dtype=torch.bool, device=device), torch.zeros(n, dtype=torch.bool, device=device),
                   local_first=local_first)


def physical_ids(ids: torch.Tensor, w: MoeWeights, local_first: bool = False) -> torch.Tensor:
    """Logical top-k ids [N, k] -> the physical slot each goes to [N, k] (ExpertMap.pick over the token's row
    index; -1 stays -1); without replicas the ids themselves. `local_first`: fault redundant-expert-twice."""
    emap = w.expert_map
    if emap is None:
        return ids
    token = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)  # [N, k]
    out = ids.clone()
    for logical in range(emap.experts):
        reps = emap.replicas(logical)
        if local_first and any(p in w.expert_ids for p in reps):
            pick = torch.full_like(ids, local_first_pick(emap, logical, 0, w.expert_ids))
        else:
            pick = torch.tensor(reps, device=ids.device)[token % len(reps)]  # [N, k]
        out = torch.where(ids == logical, pick, out)
    return out


def route(h: torch.Tensor, router: torch.Tensor, top_k: int,
          renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids [N, k] and their weights [N, k] (float32, renormalized to sum to 1 unless not
    `renormalize`) for tokens h [N, H]."""
    probs = torch.softmax((h @ router.T).float(), dim=-1)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True) if renormalize else weights


def local_renormalized(ids: torch.Tensor, weights: torch.Tensor, held: tuple[int, ...]) -> torch.Tensor:
    """The buggy weights (fault moe-router-local-renorm): the top-k weights renormalized over the
    experts this rank holds only, as a router run per EP rank on its own experts would."""
    local = torch.isin(ids, torch.tensor(held, device=ids.device))  # [N, k]
    kept = weights * local
    return kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)


def moe_activations(h: torch.Tensor, w: MoeWeights, top_k: int, local_renorm: bool = False,
                    rows: MoeRows | None = None, shared: bool = True) -> torch.Tensor:
    """This rank's MoE activations for tokens h [N, H] -> [N, E_local * F_local + Fs_local]: each local
    expert's SwiGLU activations times its routing weight (0 for tokens not routed to it), then the
    shared expert's (zeros without `shared`); `activations @ w.down.T` summed over the TP world is the
    layer's output. `local_renorm` is the fault moe-router-local-renorm; `rows` (default: every row a
    real token) masks padding rows and routes dummy rows nowhere."""
    rows = rows or MoeRows.all_real(h.shape[0], h.device)
    ids, weights = route(h, w.router, top_k, w.renormalize)
    ids = ids.masked_fill(rows.dummy[:, None], -1)  # an idle DP rank's dummy token: top-k id -1
    routed = rows.real
    if rows.dummy_wrap:  # the -1 id read as the last expert, the dummy row kept
        n = w.expert_map.experts if w.expert_map is not None else len(w.router)
        ids, routed = ids % n, routed | rows.dummy
    if local_renorm:
        weights = local_renormalized(ids, weights, w.expert_ids)
    phys = physical_ids(ids, w, rows.local_first)
    weights = weights * routed[:, None]  # [N, k]: padding rows reach no expert
    parts = []
    for j, expert in enumerate(w.expert_ids):
        share = (weights * (phys == expert)).sum(-1).to(h.dtype)  # [N]
        parts.append(share[:, None] * F.silu(h @ w.gate[j].T) * (h @ w.up[j].T))  # [N, F_local]
    if w.shared_gate is not None and w.shared_up is not None:
        act = F.silu(h @ w.shared_gate.T) * (h @ w.shared_up.T)  # [N, Fs_local]
        parts.append(act if shared else torch.zeros_like(act))
    return torch.cat(parts, dim=-1)


def shared_activations(h: torch.Tensor, w: MoeWeights, width: int) -> torch.Tensor:
    """The activations of h [N, H] with only the shared expert's columns set (the last Fs_local of `width`)."""
    out = h.new_zeros(h.shape[0], width)
    if w.shared_gate is not None and w.shared_up is not None:
        fs = w.shared_gate.shape[0]
        out[:, width - fs:] = F.silu(h @ w.shared_gate.T) * (h @ w.shared_up.T)  # [N, Fs_local]
    return out
