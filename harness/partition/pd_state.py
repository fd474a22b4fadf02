"""Disaggregated prefill/decode of a hybrid model: how each decode rank's linear-attention state (conv and
recurrent, per linear layer) is assembled from the prefill ranks' at the prompt's cut.

A rank's state is cut into slices, the unit of the transfer and of its digest:
- one per held V head: its recurrent state [Dk, Dv] and its v rows of the conv state;
- one per held K head: its q and k rows of the conv state.
Which local conv rows a slice holds comes from hybrid_layout.component_rows of that one head against the
rank's own packed q|k|v rows (conv_rows); nothing here re-derives the split. A decode rank's V head slice is
read from the prefill rank pd_layout.plan_pd_state names for it (the lowest holding it); a K head slice
from the source of the first of the rank's V heads that reads that K head (it holds the K head too).
All functions are pure; an impossible pair raises one ConfigError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.errors import ConfigError
from harness.partition.hybrid_layout import HybridShape, LinearPlan, LinearRank, component_rows
from harness.partition.pd_layout import StateSource


@dataclass(frozen=True)
class StateSlices:
    """One rank's state slices: `names` ("V head 3", "K head 1"), per slice the local V head index of its
    recurrent state (-1 for a K head slice) and its local conv rows."""

    names: tuple[str, ...]
    recurrent: tuple[int, ...]
    conv: tuple[tuple[int, ...], ...]

    def index(self, name: str) -> int:
        return self.names.index(name)


@dataclass(frozen=True)
class StateMove:
    """Decode slice `dest` is prefill rank `src_rank`'s slice `src`."""

    dest: int
    src_rank: int
    src: int


@dataclass(frozen=True)
class PDStatePlan:
    """The linear-attention state's transfer: both sides' slices per rank and each decode rank's moves."""

    prefill: tuple[StateSlices, ...]
    decode: tuple[StateSlices, ...]
    moves: tuple[tuple[StateMove, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"decode": [{"rank": r, "slices": [{"slice": self.decode[r].names[m.dest], "prefill_rank": m.src_rank,
                                                   "prefill_slice": m.src} for m in moves]}
                           for r, moves in enumerate(self.moves)]}


def state_slices(h: HybridShape, lin: LinearRank) -> StateSlices:
    """`lin`'s state slices: its V heads (local order), then its K heads (local order)."""
    local = {g: i for i, g in enumerate(g for lo, hi in lin.conv_rows for g in range(lo, hi))}
    names, recurrent, conv = [], [], []
    for i, v in enumerate(lin.v_heads):
        kh = lin.k_heads[lin.v_to_local_k[i]]
        lo, hi = component_rows(h, (kh,), (v,))[2]
        names.append(f"V head {v}")
        recurrent.append(i)
        conv.append(tuple(local[g] for g in range(lo, hi)))
    for j, kh in enumerate(lin.k_heads):
        v = lin.v_heads[lin.v_to_local_k.index(j)]
        q_rows, k_rows, _ = component_rows(h, (kh,), (v,))
        names.append(f"K head {kh}")
        recurrent.append(-1)
        conv.append(tuple(local[g] for lo, hi in (q_rows, k_rows) for g in range(lo, hi)))
    return StateSlices(tuple(names), tuple(recurrent), tuple(conv))


def plan_state_moves(h: HybridShape, prefill: LinearPlan, decode: LinearPlan,
                     sources: tuple[StateSource, ...]) -> PDStatePlan:
    """Every decode rank's state slices and the prefill slice each is read from (sources: plan_pd_state)."""
    pre = tuple(state_slices(h, r) for r in prefill.ranks)
    dec = tuple(state_slices(h, r) for r in decode.ranks)
    moves = []
    for lin, src, slices in zip(decode.ranks, sources, dec):
        mine = []
        for i, v in enumerate(lin.v_heads):
            name = f"V head {v}"
            mine.append(StateMove(slices.index(name), src.sources[i], _find(pre, src.sources[i], name)))
        for j, kh in enumerate(lin.k_heads):
            rank = src.sources[lin.v_to_local_k.index(j)]
            mine.append(StateMove(slices.index(f"K head {kh}"), rank, _find(pre, rank, f"K head {kh}")))
        moves.append(tuple(mine))
    return PDStatePlan(prefill=pre, decode=dec, moves=tuple(moves))


def same_rank_moves(plan: PDStatePlan, rank: int) -> tuple[StateMove, ...]:
    """The buggy moves (fault pd-state-same-rank): decode rank r reads its state from prefill rank r as if both
    sides split it alike, its i-th V (K) head slice from that rank's i-th V (K) head slice, where that rank has
    one; the plan's move otherwise. Equal to the plan's moves where prefill rank r holds the same heads."""
    if rank >= len(plan.prefill):
        return plan.moves[rank]
    pre, mine = plan.prefill[rank], plan.decode[rank]
    out = []
    for move in plan.moves[rank]:
        kind = mine.names[move.dest].split(" head ")[0]  # "V" or "K"
        same_kind = [j for j, name in enumerate(pre.names) if name.startswith(f"{kind} head")]
        nth = [j for j, name in enumerate(mine.names) if name.startswith(f"{kind} head")].index(move.dest)
        out.append(StateMove(move.dest, rank, same_kind[nth]) if nth < len(same_kind) else move)
    return tuple(out)


def _find(pre: tuple[StateSlices, ...], rank: int, name: str) -> int:
    if name not in pre[rank].names:
        raise ConfigError(f"prefill rank {rank} holds no linear-attention state of {name} (it holds "
                          f"{', '.join(pre[rank].names)})")
    return pre[rank].index(name)
