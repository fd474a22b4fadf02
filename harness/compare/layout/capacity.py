"""The KV pool each rank allocated, held to first principles instead of the planner's sizing function.

The layout check's pool expectation (attention.expected_pool) is the planner's pool_capacity, the function the
engine sizes its pool with, so a bug in that shared function moves both alike and the comparison agrees. This
oracle derives what a correct pool is from the model's numbers and the rank's own report, by none of the
planner's code:
- a token's KV bytes on a rank: K and V of each KV head the rank reports holding, per layer, in the dtype
  (2 x layers x kv heads held x head_dim x dtype bytes), or MLA's one latent row (layers x (kv_lora_rank +
  qk_rope_dim) x dtype bytes);
- the tokens of one max-length sequence a rank stores: counted position by position from the placement's
  definition (interleave: chunks of `size` dealt round the DCP group), its largest share over the group's
  ranks (contiguous: the whole sequence, as a one-token prompt leaves every generated token to the last rank);
- a sequence slot is that share in whole blocks; the pool is whole slots ("slots" sizing) or whole blocks
  ("blocks"): bytes = blocks x block_size x bytes per token, at most the budget, with less than one more
  slot (block) of the budget left over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.partition.layout import AttentionShape, Placement
from harness.partition.token_bytes import token_bytes
from harness.records.rankreport import RankReport


@dataclass(frozen=True)
class FirstPrinciplesPool:
    """One rank's pool as a correct engine allocates it for its budget."""

    bytes_per_token: int
    tokens_per_slot: int
    block_size: int
    budget_bytes: int
    sizing: str  # "slots" (whole sequence slots) or "blocks" (whole blocks, vLLM)

    @property
    def unit_blocks(self) -> int:
        """Blocks of one allocation unit: a whole sequence slot, or one block."""
        return -(-self.tokens_per_slot // self.block_size) if self.sizing == "slots" else 1

    @property
    def unit_bytes(self) -> int:
        return self.unit_blocks * self.block_size * self.bytes_per_token

    @property
    def blocks(self) -> int:
        return (self.budget_bytes // self.unit_bytes) * self.unit_blocks if self.unit_bytes else 0

    @property
    def pool_bytes(self) -> int:
        return self.blocks * self.block_size * self.bytes_per_token


def largest_share(max_seq_len: int, dcp: int, placement: Placement) -> int:
    """The most tokens of one max_seq_len sequence any rank of a DCP group stores, counted position by position."""
    if placement.kind == "contiguous" and dcp > 1:
        return max_seq_len  # the prompt split in runs, every generated token on the last rank: a one-token prompt
    counts = [0] * max(dcp, 1)
    for position in range(max_seq_len):
        counts[(position // placement.size) % max(dcp, 1)] += 1  # chunks of `size` dealt round the group
    return max(counts)


def pool_problems(shape: AttentionShape, dcp: int, placement: Placement, pool: Mapping[str, Any],
                  by_rank: Mapping[int, RankReport]) -> list[str]:
    """What is wrong with each rank's allocated pool against FirstPrinciplesPool (one line per rank); raises
    KeyError/TypeError/ValueError on a pool entry without budget_bytes, max_seq_len or block_size."""
    budget, max_seq, block = int(pool["budget_bytes"]), int(pool["max_seq_len"]), int(pool["block_size"])
    sizing = str(pool.get("sizing", "slots"))
    share = largest_share(max_seq, dcp, placement)
    out = []
    for r, got in sorted(by_rank.items()):
        want = FirstPrinciplesPool(token_bytes(shape, len(got.kv_heads)), share, block, budget, sizing)
        what = (f"{want.unit_blocks} blocks x {block} tokens x {want.bytes_per_token} bytes per token "
                f"({len(got.kv_heads)} KV heads held, {share} of {max_seq} tokens)")
        if got.kv_pool_bytes > budget:
            out.append(f"rank {r}'s KV pool of {got.kv_pool_bytes} bytes exceeds its budget of {budget} bytes")
        elif got.kv_pool_bytes != got.kv_pool_blocks * block * want.bytes_per_token:
            out.append(f"rank {r}'s KV pool of {got.kv_pool_blocks} blocks takes {got.kv_pool_bytes} bytes, "
                       f"{got.kv_pool_blocks * block * want.bytes_per_token} at {want.bytes_per_token} bytes per token")
        elif (got.kv_pool_blocks, got.kv_pool_bytes) != (want.blocks, want.pool_bytes):
            out.append(f"rank {r} allocated {got.kv_pool_blocks} KV blocks ({got.kv_pool_bytes} bytes), first "
                       f"principles give {want.blocks} ({want.pool_bytes} bytes): whole {sizing} of {what} "
                       f"in a budget of {budget} bytes")
    return out
