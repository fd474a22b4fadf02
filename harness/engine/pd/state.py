"""A hybrid model's linear-attention state through disaggregated prefill/decode: the state of one sequence
taken from the prefill rank's cache, digested per slice (harness/partition/pd_state.py: a V head's recurrent
state and conv rows, a K head's conv rows), assembled on a decode rank from the prefill ranks the plan names,
and placed into its state slot.

Store tensors of a prefill rank's entry, per cut n (the state after the prompt's first n tokens; the decode
side loads the prefix of a route: the decode path's start, all but the prompt's last token for generation):
    state.conv.{n} [linear layers, C, K - 1], state.rec.{n} [linear layers, Hv, Dk, Dv],
    state.digest.{n} [linear layers, slices] (taken when the prefill computed the state)
"""

from __future__ import annotations

import torch

from harness.engine.pd.store import row_digest
from harness.engine.runtime.statecache import HybridCache
from harness.partition.pd_state import StateMove, StateSlices


def state_keys(n: int) -> tuple[str, str, str]:
    """The entry's conv, recurrent and digest tensor names of the state after n tokens."""
    return f"state.conv.{n}", f"state.rec.{n}", f"state.digest.{n}"


def capture(cache: HybridCache, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of sequence `seq_id`'s conv [Ll, C, K - 1] and recurrent [Ll, Hv, Dk, Dv] state now."""
    slot = cache.slot_of[seq_id]
    return cache.conv[slot].detach().clone().cpu(), cache.recurrent[slot].detach().clone().cpu()


def state_digests(conv: torch.Tensor, rec: torch.Tensor, slices: StateSlices) -> torch.Tensor:
    """[Ll, slices] int64 digests of the bits of each slice (a V head: its conv rows and recurrent state; a
    K head: its conv rows) in every linear layer."""
    layers = conv.shape[0]
    out = []
    for i, rows in enumerate(slices.conv):
        c = conv[:, list(rows)].reshape(layers, 1, -1)  # [Ll, rows, K - 1] -> [Ll, 1, rows * (K - 1)]
        head = slices.recurrent[i]
        r = rec[:, head].reshape(layers, 1, -1) if head >= 0 else None  # [Ll, Dk, Dv] -> [Ll, 1, Dk * Dv]
        out.append(row_digest(c, r)[0])  # [1, Ll] -> [Ll]
    return torch.stack(out, dim=1)  # [Ll, slices]


def assemble(sources: dict[int, tuple[torch.Tensor, torch.Tensor]], prefill: tuple[StateSlices, ...],
             mine: StateSlices, moves: tuple[StateMove, ...], conv_like: torch.Tensor,
             rec_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This decode rank's conv [Ll, C, K - 1] and recurrent [Ll, Hv, Dk, Dv] state, each slice read from
    the prefill rank and slice of its move (`sources`: prefill rank -> its (conv, recurrent))."""
    conv, rec = torch.zeros_like(conv_like), torch.zeros_like(rec_like)
    for move in moves:
        src_conv, src_rec = sources[move.src_rank]
        src = prefill[move.src_rank]
        conv[:, list(mine.conv[move.dest])] = src_conv[:, list(src.conv[move.src])]
        if mine.recurrent[move.dest] >= 0:
            rec[:, mine.recurrent[move.dest]] = src_rec[:, src.recurrent[move.src]]
    return conv, rec


def place(cache: HybridCache, seq_id: int, conv: torch.Tensor, rec: torch.Tensor, tokens: int) -> None:
    """Write the assembled state into the sequence's slot: the state after its first `tokens` tokens."""
    slot = cache.slot_of[seq_id]
    cache.conv[slot].copy_(conv)
    cache.recurrent[slot].copy_(rec)
    cache.advance([seq_id], [tokens])
