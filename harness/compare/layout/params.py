"""Every checkpoint tensor a rank holds, against the plan: what layout.json's rank reports say they hold
(RankReport.params, harness/records/rankreport.py) against the slices the plan gives each rank
(harness/arch/param_slices.py).

For each tensor and rank: the slice held must be the planned one (per axis, and as many elements as the
slice has), a layer's tensor must be read by that layer's computation only (used_in, where the engine
says), the values held must be the checkpoint's at that slice (checksum against source), and a tensor
that another rank holds part of but this rank holds nothing of must be planned empty there. A problem names
the tensor, the rank and both slices. Ranks that report no params (an HTTP probe) are not checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.arch.param_slices import Slice, planned_slice, slice_size, sub_block
from harness.partition.hybrid_layout import HybridPlan, MoePlan
from harness.partition.layout import LayoutPlan
from harness.partition.sparse_layout import SparsePlan
from harness.records.rankreport import RankReport


@dataclass(frozen=True)
class ParamProblem:
    """One tensor held against the plan on one rank; `layer` and `block`: where it computes (sub_block)."""

    rank: int
    param: str
    text: str
    layer: int | None
    block: str
    used_in: tuple[int, ...] = ()  # the layers whose computation reads it, where the engine says

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "param": self.param, "layer": self.layer, "block": self.block,
                "used_in": list(self.used_in)}


def describe_slice(s: Slice) -> str:
    """e.g. 'rows 0-15, columns 32-47' ('all' for an axis held whole)."""
    names = ("rows", "columns", "axis 2", "axis 3")
    parts = []
    for i, axis in enumerate(s):
        text = ",".join(f"{lo}-{hi - 1}" if hi - lo > 1 else str(lo) for lo, hi in axis) or "none"
        parts.append(f"{names[min(i, len(names) - 1)] if len(s) > 1 else 'elements'} {text}")
    return ", ".join(parts) or "the scalar"


def param_problems(plan: LayoutPlan, by_rank: Mapping[int, RankReport], hybrid: HybridPlan | None = None,
                   indexer: SparsePlan | None = None, moe: MoePlan | None = None) -> list[ParamProblem]:
    """Each reporting rank's held slice and values of every checkpoint tensor against `plan` (and `hybrid`, the
    sparse-attention `indexer`, or the experts `moe` of an MLA model)."""
    reporting = {r: got.params for r, got in sorted(by_rank.items()) if got.params is not None}
    shapes: dict[str, tuple[int, ...]] = {}
    for params in reporting.values():
        shapes.update({name: shard.shape for name, shard in params.items()})
    out: list[ParamProblem] = []
    for r, params in reporting.items():
        if r >= len(plan.ranks):
            continue
        for name in sorted(shapes):
            want = planned_slice(name, shapes, r, plan, hybrid, indexer=indexer, moe=moe)
            layer, block = sub_block(name)
            got = params.get(name)
            if got is None:
                if slice_size(want):
                    out.append(ParamProblem(r, name, f"rank {r} holds nothing of {name}, planned "
                                                     f"{describe_slice(want)}", layer, block))
                continue
            if got.slice != want or got.count != slice_size(want):
                out.append(ParamProblem(r, name, f"rank {r} holds {name} {describe_slice(got.slice)} "
                                                 f"({got.count} elements), planned {describe_slice(want)} "
                                                 f"({slice_size(want)})", layer, block, got.used_in))
            elif got.used_in and layer is not None and got.used_in != (layer,):
                out.append(ParamProblem(r, name, f"rank {r} computes layer{'s' if len(got.used_in) > 1 else ''} "
                                                 f"{','.join(map(str, got.used_in))} with {name} (it belongs to layer "
                                                 f"{layer})", layer, block, got.used_in))
            elif got.checksum != got.source:
                out.append(ParamProblem(r, name, f"rank {r}'s {name} ({describe_slice(got.slice)}) differs from "
                                                 f"the checkpoint's values there (checksum {got.checksum[:12]}, "
                                                 f"checkpoint {got.source[:12]})", layer, block, got.used_in))
    return out
