"""Attention data parallel around the MoE (docs/moe-dp.md).

Under dp > 1 every rank is one DP rank: it runs the attention (and the dense parts) of its own requests
only, with the whole attention weights and its own KV cache and recurrent state. A request belongs to DP
rank `seq_id % dp` (`owner_of`), for its whole life. For each MoE layer every DP rank pads its real tokens
to the largest DP rank's count m (the global padded count), the world gathers the [dp x m] rows, every
rank runs its experts (and its columns of the shared expert) on all of them, the combine drops padding
and dummy rows, one all-reduce sums the partials and each DP rank keeps its own rows. A DP rank without a
request this forward (idle) still enters every collective: it sends one dummy token (the embedding of
token 0, through the layer's norm) routed with top-k id -1 (to no expert), the rest padding. After the
last layer the DP ranks' residual streams are summed into the whole batch (each row is non-zero on one
rank only, so the sum is exact) so every rank computes the same logits and takes the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.engine.fault import FaultFlags
from harness.engine.layers.dense import Batch
from harness.engine.layers.moe import MoeRows, MoeWeights, moe_activations, shared_activations
from harness.engine.runtime.parallel import Collectives


def owner_of(seq_id: int, dp: int) -> int:
    """The DP rank that runs request `seq_id` (its KV cache and recurrent state live there only)."""
    return seq_id % dp


@dataclass(frozen=True)
class DpSplit:
    """One forward's batch over the DP ranks: the rows this DP rank runs and every DP rank's real tokens."""

    dp: int
    rank: int
    own: tuple[int, ...]  # batch rows of this DP rank's requests
    counts: tuple[int, ...]  # real (valid) tokens of each DP rank in this forward

    @property
    def padded(self) -> int:
        """m: every DP rank's rows in the gathered MoE batch (at least 1: an idle rank's dummy token)."""
        return max(1, max(self.counts))

    @property
    def idle(self) -> bool:
        return not self.own


def split_batch(batch: Batch, dp: int, rank: int) -> DpSplit:
    """Which rows of `batch` DP rank `rank` runs, and the token count of each DP rank (every rank knows the
    whole batch: the scheduler runs alike on every rank, as a real engine's all-gathered counts)."""
    owners = [owner_of(s, dp) for s in batch.seq_ids]
    per_row = batch.valid.sum(dim=1).tolist()  # [B]
    counts = tuple(sum(n for n, o in zip(per_row, owners) if o == d) for d in range(dp))
    return DpSplit(dp, rank, tuple(b for b, o in enumerate(owners) if o == rank), counts)


def sub_batch(batch: Batch, rows: tuple[int, ...]) -> Batch:
    """The rows `rows` of `batch` (same width)."""
    index = torch.tensor(rows, dtype=torch.long, device=batch.ids.device)
    return Batch(tuple(batch.seq_ids[b] for b in rows), batch.ids[index], batch.positions[index], batch.valid[index])


def scatter_rows(part: torch.Tensor, rows: tuple[int, ...], batch_rows: int) -> torch.Tensor:
    """part [len(rows), *] placed at `rows` of a zero tensor [batch_rows, *]."""
    out = part.new_zeros(batch_rows, *part.shape[1:])
    out[list(rows)] = part
    return out


def gathered_rows(split: DpSplit, flags: FaultFlags, device: torch.device) -> MoeRows:
    """Rows of the gathered [dp x m] MoE batch: row j of DP rank d is a real token iff j < counts[d] (under
    the fault dp-pad-local-count: j < this rank's own count); row 0 of an idle DP rank is its dummy token."""
    m = split.padded
    j = torch.arange(m, device=device)
    counts = torch.tensor(split.counts, device=device)
    limit = torch.full_like(counts, split.counts[split.rank]) if flags.dp_pad_local_count else counts
    real = (j[None, :] < limit[:, None]).flatten()  # [dp, m] -> [dp * m]
    dummy = ((j[None, :] == 0) & (counts[:, None] == 0)).flatten()
    return MoeRows(real, dummy, dummy_wrap=flags.dp_dummy_wrap, local_first=flags.replica_local_first)


def combine(y: torch.Tensor, rows: MoeRows) -> torch.Tensor:
    """Each row's expert output y [N, H] put back at its real token: a row that is no real token has index
    -1 and is dropped (under dp-dummy-topk-wrap a dummy row's -1 wraps to the last real token)."""
    real_rows = rows.real.nonzero().squeeze(1)  # [n_real]
    n_real = int(real_rows.numel())
    dest = torch.full((y.shape[0],), -1, dtype=torch.long, device=y.device)
    dest[real_rows] = torch.arange(n_real, device=y.device)
    keep = rows.real | (rows.dummy & rows.dummy_wrap)
    compact = y.new_zeros(n_real, y.shape[1])
    compact.index_add_(0, dest[keep] % max(1, n_real), y[keep])
    out = torch.zeros_like(y)
    out[real_rows] = compact
    return out


def dp_moe(tokens: torch.Tensor, dummy: torch.Tensor, w: MoeWeights, top_k: int, split: DpSplit,
           world: Collectives, flags: FaultFlags) -> torch.Tensor:
    """The MoE output of this DP rank's tokens [n, H] -> [n, H] (`dummy` [H]: an idle rank's dummy token)."""
    m, H = split.padded, tokens.shape[-1]
    n = tokens.shape[0]
    padded = tokens.new_zeros(m, H)
    padded[:n] = tokens
    if split.idle:
        padded[0] = dummy
    gathered = world.gather_tp(padded, dim=0)  # [dp * m, H]: DP rank d's rows at d * m
    rows = gathered_rows(split, flags, tokens.device)
    acts = moe_activations(gathered, w, top_k, flags.router_local_renorm, rows,
                           shared=not flags.dp_shared_unreduced)  # [dp * m, A]
    y = world.reduce_tp(combine(acts @ w.down.T, rows))  # [dp * m, H], summed over the world
    out = y.view(split.dp, m, H)[split.rank, :n]  # [dp * m, H] -> [dp, m, H] -> own rows
    if flags.dp_shared_unreduced:  # the shared expert's partial of this rank only, never reduced
        out = out + shared_activations(tokens, w, acts.shape[-1]) @ w.down.T
    return out
