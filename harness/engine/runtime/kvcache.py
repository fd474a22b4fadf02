"""A paged KV cache for the KV heads one rank holds.

Fixed-size blocks in one pool per layer; each sequence owns a block table and appends the tokens this
rank stores (all of them under TP; under DCP only the ones it owns). Tokens carry their positions so a
speculative rollback can drop entries past a new length. Capacity comes from the layout planner's
budget rule (whole per-sequence slots).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import Sequence

import torch

from harness.core.errors import RunError
from harness.partition.layout import PoolCapacity


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor for a pool: on the CPU in fresh anonymous pages, which the kernel hands out zeroed when
    first touched, so a pool costs what is written to it (torch.zeros writes every byte: 64 MiB per rank
    per launch at the default budget); elsewhere torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor keeps the mapping alive (torch.frombuffer holds a reference to the buffer)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@dataclass
class SequenceState:
    """One sequence's block table and the positions of the tokens stored here, in storage order."""

    blocks: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prompt_len: int = 0  # tokens of the sequence's first forward (the contiguous DCP placement deals them)
    dense: bool = True  # positions == [0, 1, ..., stored - 1] (storage slot j holds position j)

    @property
    def stored(self) -> int:
        return len(self.positions)


class PagedKVCache:
    """Pools k/v[layer]: [num_blocks, block_size, kv_heads_local, head_dim]. With `values` False only
    the k pools exist (an MLA latent cache: one row per token that serves as key and value)."""

    def __init__(self, capacity: PoolCapacity, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, values: bool = True) -> None:
        self.capacity = capacity
        self.block_size = capacity.block_size
        shape = (capacity.blocks, capacity.block_size, kv_heads, head_dim)
        self.k = [zeroed(shape, dtype, device) for _ in range(layers)]
        self.v = [zeroed(shape, dtype, device) for _ in range(layers)] if values else []
        self._free = list(range(capacity.blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}  # block -> holders (sequences and prefix-cache pins) beyond the first
        self.seqs: dict[int, SequenceState] = {}
        self._next_id = 0

    @property
    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def open(self, n: int) -> list[int]:
        """Register n new, empty sequences; returns their ids (never reused)."""
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for seq_id in ids:
            self.add_sequence(seq_id)
        return ids

    def close(self, seq_ids: Sequence[int]) -> None:
        """Free the blocks of finished sequences."""
        for seq_id in seq_ids:
            self.free_sequence(seq_id)

    def positions(self, seq_id: int) -> list[int]:
        """Positions whose K/V this cache holds for `seq_id`, in storage order."""
        return list(self.seqs[seq_id].positions)

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise RunError(f"sequence {seq_id} already in the KV cache")
        self.seqs[seq_id] = SequenceState()

    def free_sequence(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id)
        for block in reversed(state.blocks):
            self._release(block)

    def _release(self, block: int) -> None:
        """Drop one holder of `block`; the last one returns it to the free list."""
        extra = self._refs.get(block, 0)
        if extra:
            self._refs[block] = extra - 1
        else:
            self._refs.pop(block, None)
            self._free.append(block)

    def pin(self, blocks: Sequence[int]) -> None:
        """Hold `blocks` beyond their sequences (the prefix cache's copy of them)."""
        for block in blocks:
            self._refs[block] = self._refs.get(block, 0) + 1

    def unpin(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._release(block)

    def share(self, seq_id: int, blocks: Sequence[int], positions: list[int]) -> None:
        """Start empty sequence `seq_id` on whole blocks another sequence wrote (a prefix-cache hit):
        `positions` are the positions those blocks store, in storage order (len = blocks x block_size)."""
        state = self.seqs[seq_id]
        if state.blocks or len(positions) != len(blocks) * self.block_size:
            raise RunError(f"sequence {seq_id}: a shared prefix needs an empty sequence and whole blocks "
                           f"({len(positions)} positions for {len(blocks)} blocks of {self.block_size})")
        self.pin(blocks)
        state.blocks.extend(blocks)
        state.positions.extend(positions)
        state.dense = positions == list(range(len(positions)))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def reset(self) -> None:
        for seq_id in list(self.seqs):
            self.free_sequence(seq_id)

    def reserve(self, seq_id: int, positions: list[int]) -> list[tuple[int, int]]:
        """Allocate storage for `positions` (appended in order); returns (block, offset) of each."""
        state = self.seqs[seq_id]
        first = state.stored
        end = first + len(positions)
        missing = -(-end // self.block_size) - len(state.blocks)
        if missing > len(self._free):
            raise RunError(f"KV pool exhausted: {self.capacity.blocks} blocks of {self.block_size} tokens "
                           f"are all in use (sequence {seq_id} needs {missing - len(self._free)} more)")
        for _ in range(max(0, missing)):
            state.blocks.append(self._free.pop())
        state.positions.extend(positions)
        state.dense = state.dense and positions == list(range(first, end))
        bs, blocks = self.block_size, state.blocks
        return [(blocks[i // bs], i % bs) for i in range(first, end)]

    def write(self, layer: int, slots: list[tuple[int, int]], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [n, kv_heads, head_dim] at `slots` (n entries) of `layer`."""
        if not slots:
            return
        blocks = torch.tensor([b for b, _ in slots], device=k.device)
        offsets = torch.tensor([o for _, o in slots], device=k.device)
        self.k[layer][blocks, offsets] = k
        self.v[layer][blocks, offsets] = v

    def rows(self, slots: list[tuple[int, int]]) -> torch.Tensor:
        """(block, offset) slots -> rows of the flattened pool [blocks * block_size, ...]: [n]."""
        return torch.tensor([b * self.block_size + o for b, o in slots], dtype=torch.long,
                            device=self.k[0].device)

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store k/v [n, kv_heads, head_dim] at flattened-pool `rows` [n] of `layer` (see rows());
        v is None for a cache without value pools."""
        if rows.numel() == 0:
            return
        # [blocks, block, kv, hd] -> [blocks * block, kv, hd] view; index_copy_ writes through it
        self.k[layer].view(-1, *self.k[layer].shape[2:]).index_copy_(0, rows, k)
        if v is not None:
            self.v[layer].view(-1, *self.v[layer].shape[2:]).index_copy_(0, rows, v)

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored k/v of a sequence: [stored, kv_heads, head_dim] each, in storage order."""
        state = self.seqs[seq_id]
        n = state.stored
        if n == 0:
            empty = self.k[layer].new_zeros((0, *self.k[layer].shape[2:]))
            return empty, empty.clone()
        blocks = torch.tensor(state.blocks, device=self.k[layer].device)
        # [n_blocks, block_size, kv, hd] -> [n_blocks * block_size, kv, hd] -> first n tokens
        k = self.k[layer][blocks].flatten(0, 1)[:n]
        v = self.v[layer][blocks].flatten(0, 1)[:n]
        return k, v

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop stored tokens at positions >= length (speculative rollback) and free emptied blocks."""
        state = self.seqs[seq_id]
        keep = [p for p in state.positions if p < length]
        if keep != state.positions[:len(keep)]:
            raise RunError("KV cache positions are not in increasing order; cannot roll back")
        state.positions = keep
        needed = -(-len(keep) // self.block_size)
        while len(state.blocks) > needed:
            self._release(state.blocks.pop())
