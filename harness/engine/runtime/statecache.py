"""The hybrid model's cache: the paged KV cache of its full-attention layers plus one recurrent-state
slot per sequence for its linear-attention layers, both sized from one slot count (grouped capacity,
harness/partition/hybrid_layout.py). The state of a sequence is kept whole on every rank (never split by token
under DCP)."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from harness.core.errors import RunError
from harness.engine.layers.deltanet import LinearState, LinearSteps
from harness.engine.runtime.kvcache import PagedKVCache, zeroed
from harness.partition.layout import PoolCapacity

KEPT_DIGESTS = 8
SNAPSHOT_TOKENS = 16  # chunks up to this long keep the state after each token (speculative verify steps)


class HybridCache(PagedKVCache):
    """KV pools k/v[full layer] as PagedKVCache, and state pools conv [slots, linear layers, C, K - 1],
    recurrent [slots, linear layers, Hv, Dk, Dv]."""

    def __init__(self, capacity: PoolCapacity, full_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, state_slots: int, linear_layers: int, conv_shape: tuple[int, int],
                 recurrent_shape: tuple[int, int, int], state_dtype: torch.dtype, reset_slots: bool = True) -> None:
        super().__init__(capacity, full_layers, kv_heads, head_dim, dtype, device)
        self.reset_slots = reset_slots  # False: the state-slot-stale fault (a reused slot keeps its old state)
        self.state_slots = state_slots
        self.conv = zeroed((state_slots, linear_layers, *conv_shape), dtype, device)
        self.recurrent = zeroed((state_slots, linear_layers, *recurrent_shape), state_dtype, device)
        self._free_slots = list(range(state_slots - 1, -1, -1))
        self.slot_of: dict[int, int] = {}
        self.state_length: dict[int, int] = {}  # tokens folded into each sequence's state
        self.final_digests: list[str] = []  # sha256 of the last closed sequences' recurrent states
        # per sequence: the state length before its latest chunk and, per linear layer, the states after
        # each token of that chunk (a speculative rollback restores one of them)
        self.snapshots: dict[int, tuple[int, dict[int, LinearSteps]]] = {}
        self.kernel = conv_shape[1] + 1

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def add_sequence(self, seq_id: int) -> None:
        if not self._free_slots:
            raise RunError(f"recurrent-state slots exhausted: all {self.state_slots} are in use "
                           f"(sequence {seq_id} needs one)")
        super().add_sequence(seq_id)
        slot = self._free_slots.pop()
        self.slot_of[seq_id] = slot
        self.state_length[seq_id] = 0
        if self.reset_slots:
            self.conv[slot].zero_()
            self.recurrent[slot].zero_()

    def free_sequence(self, seq_id: int) -> None:
        super().free_sequence(seq_id)
        slot = self.slot_of.pop(seq_id)
        if self.state_length[seq_id]:  # the whole state a finished sequence leaves: equal across a DCP group
            digest = hashlib.sha256(self.recurrent[slot].detach().cpu().contiguous().numpy().tobytes())
            self.final_digests = (self.final_digests + [digest.hexdigest()[:16]])[-KEPT_DIGESTS:]
        self._free_slots.append(slot)
        del self.state_length[seq_id]
        self.snapshots.pop(seq_id, None)

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop K/V past `length` and restore the recurrent state after `length` tokens, from the snapshots
        of the sequence's latest chunk (a rollback further back is an error)."""
        have = self.state_length[seq_id]
        if length < have:
            start, layers = self.snapshots.get(seq_id, (have, {}))
            if not layers or length < start:
                raise RunError(f"sequence {seq_id}: a recurrent state of {have} tokens cannot be rolled back to "
                               f"{length} (snapshots cover lengths {start}..{have})")
            for layer, steps in layers.items():
                self.store_state(seq_id, layer, steps.after(length - start, self.kernel))
            self.state_length[seq_id] = length
        super().truncate(seq_id, length)

    def keep_snapshots(self, seq_id: int, layer: int, steps: LinearSteps) -> None:
        """The states after each token of the chunk just folded into `layer` (before advance())."""
        start = self.state_length[seq_id]
        if layer == 0 or seq_id not in self.snapshots:
            self.snapshots[seq_id] = (start, {})
        self.snapshots[seq_id][1][layer] = steps

    def state(self, seq_id: int, layer: int) -> LinearState:
        """Views of sequence `seq_id`'s state in linear layer `layer` (index among the linear layers)."""
        slot = self.slot_of[seq_id]
        return LinearState(self.conv[slot, layer], self.recurrent[slot, layer])

    def store_state(self, seq_id: int, layer: int, state: LinearState) -> None:
        slot = self.slot_of[seq_id]
        self.conv[slot, layer].copy_(state.conv)
        self.recurrent[slot, layer].copy_(state.recurrent)

    def advance(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        """Record that `lengths[b]` more tokens of seq_ids[b] went into its state."""
        for seq_id, n in zip(seq_ids, lengths):
            self.state_length[seq_id] += n
