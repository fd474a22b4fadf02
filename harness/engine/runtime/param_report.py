"""What a rank holds of every checkpoint tensor, found by tracing its own sharding code.

The rank's shard function (the one that built its weights) is run once more on index weights: every
element of every checkpoint tensor replaced by a unique number (its tensor's offset + its flat index + 1, in
float64, exact below 2^53). Each element of the resulting local tensors then names the checkpoint element
it was loaded from, whatever the code did on the way (head selection, transposes, concatenation, padding,
masking: zero names nothing), so every tensor is covered without a list of names. The held elements of
each checkpoint tensor give its slice (per axis the indices held), the layers whose computation reads them
(a list named `layers` in the rank's weights indexes them) and the rank's values there its checksum,
next to the checksum of the same elements of the checkpoint (harness/records/rankreport.py: ParamShard);
the layout check holds the slice against the plan (harness/arch/param_slices.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Iterator

import numpy as np
import torch

from harness.arch.param_slices import ranges_of
from harness.records.rankreport import ParamShard

ShardFn = Callable[[dict[str, torch.Tensor], torch.dtype], Any]


# the trace holds about 40 bytes per checkpoint element at its peak (index numbers, the traced shard, sorted ids):
# above this many elements (a real checkpoint, e.g. smollm2-135m's 135M) it is not run and the rank reports no
# per-tensor record (the layout check's other parts still run; docs/checks.md)
TRACE_LIMIT_ELEMENTS = 16_000_000

LAYERS = "layers"  # a list field or key of this name holds the model's layers by global index


def tensors_of(held: Any, layer: int = -1, named: str = "") -> Iterator[tuple[int, torch.Tensor]]:
    """(layer, tensor) for every tensor in a structure of dataclasses, lists, tuples and dicts, in a fixed
    order; `layer` is the index in the innermost list named LAYERS above it (-1: outside the layers)."""
    if isinstance(held, torch.Tensor):
        yield layer, held
    elif dataclasses.is_dataclass(held) and not isinstance(held, type):
        for f in dataclasses.fields(held):
            yield from tensors_of(getattr(held, f.name), layer, f.name)
    elif isinstance(held, (list, tuple)):
        for i, item in enumerate(held):
            yield from tensors_of(item, i if named == LAYERS else layer)
    elif isinstance(held, dict):
        for key in sorted(held):
            yield from tensors_of(held[key], layer, str(key))


def _digest(values: torch.Tensor) -> str:
    return hashlib.sha256(values.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _distinct(values: np.ndarray, size: int) -> np.ndarray:
    """The distinct values of `values` (integers in [0, size)), sorted: np.unique's answer by marking them in a
    [size] mask, in one pass instead of a sort (and without np.unique's first-use import of numpy.ma, which each
    forked rank would pay again)."""
    seen = np.zeros(size, dtype=bool)
    seen[values] = True
    return np.flatnonzero(seen)


def held_params(shard: ShardFn, held: Any, full: dict[str, torch.Tensor],
                dtype: torch.dtype) -> dict[str, ParamShard] | None:
    """name -> ParamShard for every checkpoint tensor of `full` the rank holds an element of; `held` is
    what shard(full, dtype) built (the rank's weights), `shard` is called again on index weights. None for
    a checkpoint of more than TRACE_LIMIT_ELEMENTS elements."""
    if sum(t.numel() for t in full.values()) > TRACE_LIMIT_ELEMENTS:
        return None
    names = sorted(full)
    sizes = [full[n].numel() for n in names]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [T + 1]
    numbers = torch.arange(1, int(offsets[-1]) + 1, dtype=torch.float64)  # every element's number, once
    index = {n: numbers[offsets[i]:offsets[i + 1]].view(full[n].shape) for i, n in enumerate(names)}
    traced = list(tensors_of(shard(index, torch.float64)))
    real = list(tensors_of(held))
    if [t.shape for _, t in traced] != [t.shape for _, t in real]:
        raise RuntimeError("the traced shard does not have the shape of the rank's weights")
    ids_parts, value_parts, layer_parts = [], [], []
    for (layer, t), (_, r) in zip(traced, real):
        flat = t.detach().cpu().flatten()
        ids = flat.to(torch.int64)
        keep = (ids > 0) & (ids.to(torch.float64) == flat)  # loaded unchanged from one checkpoint element
        ids_parts.append(ids[keep].numpy() - 1)
        value_parts.append(r.detach().cpu().flatten()[keep].float())
        layer_parts.append(np.full(ids_parts[-1].size, layer, dtype=np.int64))
    if not ids_parts:
        return {}
    ids, layers = np.concatenate(ids_parts), np.concatenate(layer_parts)
    num_layers = int(layers.max()) + 1 if layers.size else 0
    values = torch.cat(value_parts)
    order = np.argsort(ids, kind="stable")
    ids, layers, values = ids[order], layers[order], values[torch.from_numpy(order)]
    first = np.concatenate([[True], ids[1:] != ids[:-1]])  # one value per element: its first copy
    bounds = np.searchsorted(ids, offsets)  # each tensor's run of sorted ids
    out: dict[str, ParamShard] = {}
    for t, name in enumerate(names):
        lo, hi = int(bounds[t]), int(bounds[t + 1])
        if lo == hi:
            continue
        pick = first[lo:hi]
        flat = ids[lo:hi][pick] - offsets[t]  # flat indices held, sorted
        shape = tuple(full[name].shape)
        coords = np.unravel_index(flat, shape) if shape else ()
        axes = tuple(ranges_of(_distinct(c, size).tolist()) for c, size in zip(coords, shape))
        source = full[name].flatten()[torch.from_numpy(flat)].to(dtype)
        used = _distinct(layers[lo:hi] + 1, num_layers + 1) - 1  # layer -1 (outside the layers) shifted to 0
        out[name] = ParamShard(shape=shape, slice=axes, count=int(flat.size),
                               checksum=_digest(values[lo:hi][torch.from_numpy(pick)]), source=_digest(source),
                               used_in=tuple(int(x) for x in used if x >= 0))
    return out
