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


def held_params(shard: ShardFn, held: Any, full: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, ParamShard]:
    """name -> ParamShard for every checkpoint tensor of `full` the rank holds an element of; `held` is
    what shard(full, dtype) built (the rank's weights), `shard` is called again on index weights."""
    names = sorted(full)
    sizes = [full[n].numel() for n in names]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [T + 1]
    index = {n: (torch.arange(sizes[i], dtype=torch.float64) + float(offsets[i] + 1)).view(full[n].shape)
             for i, n in enumerate(names)}
    traced = list(tensors_of(shard(index, torch.float64)))
    real = list(tensors_of(held))
    if [t.shape for _, t in traced] != [t.shape for _, t in real]:
        raise RuntimeError("the traced shard does not have the shape of the rank's weights")
    ids_parts, value_parts = [], []
    used: dict[int, set[int]] = {}  # tensor index -> the layers whose computation reads it
    for (layer, t), (_, r) in zip(traced, real):
        flat = t.detach().cpu().flatten()
        keep = (flat > 0.5) & (flat == flat.round())  # loaded unchanged from one checkpoint element
        ids = flat[keep].to(torch.int64) - 1
        ids_parts.append(ids)
        value_parts.append(r.detach().cpu().flatten()[keep].float())
        if layer >= 0 and ids.numel():
            for t_index in np.unique(np.searchsorted(offsets, ids.numpy(), side="right") - 1):
                used.setdefault(int(t_index), set()).add(layer)
    ids = torch.cat(ids_parts).numpy() if ids_parts else np.zeros(0, dtype=np.int64)
    values = torch.cat(value_parts) if value_parts else torch.zeros(0)
    unique, first = np.unique(ids, return_index=True)  # sorted global ids, one value each
    which = np.searchsorted(offsets, unique, side="right") - 1  # the tensor of each id
    out: dict[str, ParamShard] = {}
    for t in np.unique(which):
        name = names[int(t)]
        sel = which == t
        flat = unique[sel] - offsets[t]  # flat indices held, sorted
        coords = np.unravel_index(flat, tuple(full[name].shape)) if full[name].dim() else ()
        axes = tuple(ranges_of(int(i) for i in np.unique(c)) for c in coords)
        source = full[name].flatten()[torch.from_numpy(flat)].to(dtype)
        out[name] = ParamShard(shape=tuple(full[name].shape), slice=axes, count=int(flat.size),
                               checksum=_digest(values[torch.from_numpy(first[sel])]), source=_digest(source),
                               used_in=tuple(sorted(used.get(int(t), ()))))
    return out
