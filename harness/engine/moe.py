"""Mixture-of-experts FFN with a shared expert, one rank's experts, no distributed code.

Every rank holds all tokens (the residual stream is replicated under TP), computes the router (its
weights replicated) for all of them, runs its own experts' column shards on the tokens routed to
them (a mask: weight 0 for the others) and its shard of the shared expert; the caller sums the
partials over the TP world with one all-reduce. This is the all-gather + mask form of expert
parallel (tokens need no gather here, they are already on every rank), not all-to-all dispatch.

Routing: softmax over all experts in float32, top-k, the k weights renormalized to sum to 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    expert_ids: tuple[int, ...]


def route(h: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids [N, k] and their renormalized weights [N, k] (float32) for tokens h [N, H]."""
    probs = torch.softmax((h @ router.T).float(), dim=-1)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def local_renormalized(ids: torch.Tensor, weights: torch.Tensor, held: tuple[int, ...]) -> torch.Tensor:
    """The buggy weights (fault moe-router-local-renorm): the top-k weights renormalized over the
    experts this rank holds only, as a router run per EP rank on its own experts would."""
    local = torch.isin(ids, torch.tensor(held, device=ids.device))  # [N, k]
    kept = weights * local
    return kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)


def moe_activations(h: torch.Tensor, w: MoeWeights, top_k: int, local_renorm: bool = False) -> torch.Tensor:
    """This rank's MoE activations for tokens h [N, H] -> [N, E_local * F_local + Fs_local]: each local
    expert's SwiGLU activations times its routing weight (0 for tokens not routed to it), then the
    shared expert's; `activations @ w.down.T` summed over the TP world is the layer's output.
    `local_renorm` is the fault moe-router-local-renorm."""
    ids, weights = route(h, w.router, top_k)
    if local_renorm:
        weights = local_renormalized(ids, weights, w.expert_ids)
    parts = []
    for j, expert in enumerate(w.expert_ids):
        share = (weights * (ids == expert)).sum(-1).to(h.dtype)  # [N]
        parts.append(share[:, None] * F.silu(h @ w.gate[j].T) * (h @ w.up[j].T))  # [N, F_local]
    if w.shared_gate is not None and w.shared_up is not None:
        parts.append(F.silu(h @ w.shared_gate.T) * (h @ w.shared_up.T))  # [N, Fs_local]
    return torch.cat(parts, dim=-1)
