"""What each rank says it holds: the typed rank report of layout.json.

Every engine writes one RankReport per rank into each entry of layout.json ("target", and "speculator"
with the draft/MTP model's ranks); the layout checks and the report read them back with `read_ranks`.
The embedded engine builds them in harness/engine/runtime/parallelize.py (rank_report), an HTTP engine's layout
probe in harness/backends/http/layout.py. This module is the schema: its fields, their JSON names and its
version (RANK_REPORT_SCHEMA, recorded in layout.json as contract.LAYOUT_SCHEMA_KEY).

JSON shape of one rank (schema 1; keys in this order, optional ones omitted when absent; head ids are
global; [lo, hi) ranges are two-element lists):

  rank, q_heads, kv_heads, v_heads?, dcp_group, dcp_rank, dcp_members, kv_tp_rank, q_to_kv,
  ffn_shard?, vocab_shard?, group_q_heads, group_q_to_kv, kv_pool_bytes, kv_pool_blocks,
  kv_block_size?, kv_bytes_per_token?, kv_weight_checksums {"<kv head>": hex},
  stored_positions? {length, prompt_len, positions},
  hybrid? {linear: {...}, moe: {...} | null, cache_groups: {...}},
  q_mode?, q_weight_heads?, q_weight_checksums?, latent_dim?   (RankReport.mla, inline: all four or none)
  sparse? {index_heads, index_weight_checksums, index_key_checksum, cache_group_blocks, block_size,
           selected [layer][query] -> positions, margins [layer][query]}
  layers?, layers_differing?                                     (an HTTP probe's per-layer heads)
  params? {"<checkpoint tensor>": {shape, slice, count, checksum, source, used_in}}  (every weight the rank holds)

A run folder whose layout.json has no schema key was written before the key existed, in the shape of
schema 1, and reads as schema 1; any other version is refused (LayoutSchemaError).
"""

from __future__ import annotations

import functools
import types
from dataclasses import MISSING, dataclass, fields, is_dataclass, replace
from typing import Any, Callable, Mapping, Sequence, TypeVar, Union, get_args, get_origin, get_type_hints

from harness.core.errors import RunError

RANK_REPORT_SCHEMA = 1


class LayoutSchemaError(RunError):
    """layout.json breaks the rank report's schema: names the entry, the rank and the field."""


@dataclass(frozen=True)
class StoredPositions:
    """The positions whose K/V (or latent row) this rank stored of the engine's first decode-path
    sequence: `length` tokens, the first `prompt_len` of them prefilled."""

    length: int
    prompt_len: int
    positions: tuple[int, ...]


@dataclass(frozen=True)
class ParamShard:
    """What a rank holds of one checkpoint tensor (canonical name): the tensor's full `shape`, the `slice` of
    it the rank holds (per axis, the [lo, hi) ranges of the indices it holds some element of), `count`
    elements held (the slice's size when the held part is a product of the axes' index sets), the
    `checksum` of the held values as the rank computes with them (in global flat-index order, as float32),
    the `source` checksum of the same elements of the checkpoint tensor cast to the run's dtype, and the
    layers whose computation reads them (`used_in`; empty where the engine does not say)."""

    shape: tuple[int, ...]
    slice: tuple[tuple[tuple[int, int], ...], ...]
    count: int
    checksum: str
    source: str
    used_in: tuple[int, ...] = ()


@dataclass(frozen=True)
class MLAReport:
    """An MLA rank: its Q mode (split by tp or replicated in the DCP group), the heads whose Q weights
    (q_b_proj, w_kc) it holds with their checksums, and the latent row width as its cache allocated it."""

    q_mode: str
    q_weight_heads: tuple[int, ...]
    q_weight_checksums: dict[str, str]
    latent_dim: int


@dataclass(frozen=True)
class LinearReport:
    """Linear attention (Gated DeltaNet) of a rank: its V / K heads, the V heads whose output it adds,
    the packed q|k|v in_proj/conv rows it loaded, the digests of the recurrent states the last finished
    sequences left, and one checksum of its linear weights."""

    v_heads: tuple[int, ...]
    k_heads: tuple[int, ...]
    out_v_heads: tuple[int, ...]
    conv_rows: tuple[tuple[int, int], ...]
    state_digests: tuple[str, ...]
    weight_checksum: str
    recurrent_heads: int | None = None  # an HTTP probe: V heads the recurrent state tensor holds
    conv_channels: int | None = None  # an HTTP probe: channels the conv state tensor holds
    state_bytes_per_slot: int | None = None  # an HTTP probe: conv + recurrent state bytes of one sequence, all layers


@dataclass(frozen=True)
class ExpertsReport:
    """MoE of a rank: the experts it routes to (ids as it routes them: physical slots), its [lo, hi) share
    of each expert's FFN, its columns per expert, its shared-expert columns, its router's checksum, and
    per slot the logical expert it loaded and a checksum of those weights (replicas must agree)."""

    experts: tuple[int, ...]
    expert_ffn_shard: tuple[int, int]
    expert_columns: int
    shared_columns: int
    router_checksum: str
    logical: tuple[int, ...] = ()  # the logical expert whose weights each of its physical slots holds
    slot_checksums: tuple[str, ...] = ()  # per physical slot: checksum of its gate / up / down columns


@dataclass(frozen=True)
class CacheGroupsReport:
    """A hybrid rank's cache groups as allocated: slots, attention blocks (and per sequence), recurrent
    state slots and the bytes of each group."""

    slots: int
    attention_blocks: int
    attention_blocks_per_seq: int
    state_slots: int
    state_bytes: int
    attention_bytes: int


@dataclass(frozen=True)
class HybridReport:
    """A hybrid model's rank: linear attention, experts (None without MoE layers) and cache groups."""

    linear: LinearReport
    moe: ExpertsReport | None
    cache_groups: CacheGroupsReport


@dataclass(frozen=True)
class SparseReport:
    """A sparse-attention rank (harness/engine/layers/sparse.py): the indexer heads whose Q / weight rows it holds
    with their checksums, the replicated indexer key projection's checksum, the blocks each cache group
    holds (its block_size tokens per block) and the selection trace of the engine's first forward's first
    sequence: per layer, per query position, the token positions the attention read (sorted) and the
    indexer's relative score margin between the last selected and the first unselected token (1: no
    competitor)."""

    index_heads: tuple[int, ...]
    index_weight_checksums: dict[str, str]
    index_key_checksum: str
    cache_group_blocks: dict[str, int]
    block_size: int
    selected: tuple[tuple[tuple[int, ...], ...], ...]
    margins: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class ProbeLayer:
    """One attention layer as an HTTP engine's probe saw it: the head ids its Q/K/V projections hold (as
    loaded: None where no checkpoint shard matched) and those its shard parameters claim."""

    layer: str
    q_heads: tuple[int, ...] | None
    k_heads: tuple[int, ...] | None
    v_heads: tuple[int, ...] | None
    claimed_q_heads: tuple[int, ...]
    claimed_kv_heads: tuple[int, ...]


@dataclass(frozen=True)
class RankReport:
    """What one rank holds and reads. Head ids global; q_to_kv: the KV head each own Q head reads;
    group_*: the same over the rank's DCP group; kv_pool_*: its KV pool as allocated; the optional
    records are the parts only some engines or architectures have."""

    rank: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    dcp_group: int
    dcp_rank: int
    dcp_members: tuple[int, ...]
    kv_tp_rank: int
    q_to_kv: tuple[int, ...]
    group_q_heads: tuple[int, ...]
    group_q_to_kv: tuple[int, ...]
    kv_pool_bytes: int
    kv_pool_blocks: int
    kv_weight_checksums: dict[str, str]
    v_heads: tuple[int, ...] | None = None          # V heads as loaded (an HTTP probe: they may differ from K)
    ffn_shard: tuple[int, int] | None = None        # [lo, hi) MLP columns
    vocab_shard: tuple[int, int] | None = None      # [lo, hi) token ids of the embedding / lm_head
    kv_block_size: int | None = None                # tokens per KV block (an HTTP probe)
    kv_bytes_per_token: int | None = None           # the KV cache's bytes per stored token, as allocated
    stored_positions: StoredPositions | None = None
    hybrid: HybridReport | None = None
    mla: MLAReport | None = None
    sparse: SparseReport | None = None
    layers: tuple[ProbeLayer, ...] | None = None    # an HTTP probe's per-layer heads
    layers_differing: tuple[str, ...] | None = None  # the probe's layers whose heads differ from the chosen ids
    params: dict[str, ParamShard] | None = None     # every checkpoint tensor the rank holds part of (embedded engine)
    experts: ExpertsReport | None = None            # experts beside MLA (a hybrid model's are in hybrid.moe)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of layout.json's `ranks` list (WIRE_ORDER; None fields omitted)."""
        out: dict[str, Any] = {}
        for name in WIRE_ORDER:
            value = getattr(self, name)
            if value is None:
                continue
            if name == "mla":
                out.update(_to_json(value))
            else:
                out[name] = _to_json(value)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "layout.json", index: int | None = None) -> RankReport:
        """Parse and validate one rank's JSON object (entry `where`, its `index`-th rank); a missing,
        unknown or mistyped field raises one LayoutSchemaError naming `where`, the rank and the field."""
        rank = data.get("rank") if isinstance(data, Mapping) else None
        at = (f"{where} rank {rank}" if isinstance(rank, int) and not isinstance(rank, bool)
              else f"{where} ranks[{index}]" if index is not None else where)
        if not isinstance(data, Mapping):
            raise LayoutSchemaError(f"{at}: a rank report is {type(data).__name__}, not an object")
        if "mla" in data:  # no JSON key: the MLA record's fields sit inline
            raise LayoutSchemaError(f"{at}: unknown field 'mla' (the MLA fields {', '.join(_MLA_KEYS)} sit inline)")
        flat = dict(data)
        inline = {k: flat.pop(k) for k in _MLA_KEYS if k in flat}
        report = _from_json(cls, flat, at, "")
        return replace(report, mla=_from_json(MLAReport, inline, at, "")) if inline else report


_MLA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(MLAReport))
# the JSON key order of a rank (schema 1): the order both engine families have always written
WIRE_ORDER: tuple[str, ...] = (
    "rank", "q_heads", "kv_heads", "v_heads", "dcp_group", "dcp_rank", "dcp_members", "kv_tp_rank", "q_to_kv",
    "ffn_shard", "vocab_shard", "group_q_heads", "group_q_to_kv", "kv_pool_bytes", "kv_pool_blocks",
    "kv_block_size", "kv_bytes_per_token", "kv_weight_checksums", "stored_positions", "hybrid", "mla", "sparse",
    "layers", "layers_differing", "params", "experts")


@dataclass(frozen=True)
class SpeculatorReport:
    """What layout.json's "speculator" entry says besides its ranks: the speculator's kind (draft, mtp),
    its layers and the slots the planner grants it."""

    kind: str
    layers: int
    slots: int


def entry_json(ranks: Sequence[RankReport], pool: Mapping[str, int] | None,
               speculator: SpeculatorReport | None = None) -> dict[str, Any]:
    """One entry of layout.json: the speculator's header (when it is the speculator's), its ranks in
    rank order and the pool it was sized from ({budget_bytes, max_seq_len, block_size})."""
    head = _to_json(speculator) if speculator is not None else {}
    return {**head, "ranks": [r.to_json() for r in sorted(ranks, key=lambda r: r.rank)],
            "pool": dict(pool) if pool is not None else None}


def hybrid_from_json(data: Any, where: str) -> HybridReport:
    """A hybrid record (an HTTP probe's `hybrid` object) parsed and validated as RankReport.hybrid is."""
    return _from_json(HybridReport, data, where, "hybrid.")


def read_ranks(entry: Any, where: str = "layout.json") -> tuple[RankReport, ...]:
    """The rank reports of one layout.json entry (its "ranks" list, which must not be empty), parsed;
    LayoutSchemaError names what is missing or mistyped."""
    ranks = entry.get("ranks") if isinstance(entry, Mapping) else None
    if not isinstance(ranks, list) or not ranks:
        raise LayoutSchemaError(f"{where} has no 'ranks' list")
    return tuple(RankReport.from_json(r, where, i) for i, r in enumerate(ranks))


def read_speculator(entry: Any, where: str = "layout.json speculator") -> SpeculatorReport:
    """The header of layout.json's "speculator" entry (kind, layers, slots)."""
    if not isinstance(entry, Mapping):
        raise LayoutSchemaError(f"{where} is {type(entry).__name__}, not an object")
    return _from_json(SpeculatorReport, {f.name: entry[f.name] for f in fields(SpeculatorReport) if f.name in entry},
                      where, "")


def schema_problem(layout: Any, key: str) -> str | None:
    """Why layout.json (its whole object) cannot be read as RANK_REPORT_SCHEMA, or None. No `key`: a
    folder written before the version was recorded, in schema 1's shape."""
    if not isinstance(layout, Mapping):
        return f"layout.json is {type(layout).__name__}, not an object"
    version = layout.get(key, 1)
    if version != RANK_REPORT_SCHEMA:
        return (f"layout.json has rank report schema {version!r}; this harness reads schema {RANK_REPORT_SCHEMA} "
                f"(harness/records/rankreport.py): run the cell again with this harness")
    return None


# ---- JSON <-> dataclasses, by the fields' type hints ----------------------------------------------------

_D = TypeVar("_D")


def _to_json(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _from_json(cls: type[_D], data: Any, at: str, path: str) -> _D:
    """An instance of dataclass `cls` from JSON object `data`; errors say '<at>: field <path.name> ...'.
    Well-formed data goes through the class's compiled reader; anything it does not take goes through
    the field-by-field reading below, which names the first problem."""
    try:
        return _reader(cls)(data)  # type: ignore[no-any-return]
    except _Mismatch:
        return _checked(cls, data, at, path)


def _checked(cls: type[_D], data: Any, at: str, path: str) -> _D:
    """_from_json field by field, naming what is missing or mistyped."""
    if not isinstance(data, Mapping):
        what = path.rstrip(".") or cls.__name__
        raise LayoutSchemaError(f"{at}: field {what!r} is {_kind(data)}, expected an object")
    schema = _schema(cls)
    unknown = sorted(set(data) - schema.known)
    if unknown:
        raise LayoutSchemaError(f"{at}: unknown field {path}{unknown[0]!r}; known: {', '.join(sorted(schema.known))}")
    values: dict[str, Any] = {}
    for field_name, hint, required in schema.fields:
        name = f"{path}{field_name}"
        if field_name not in data:
            if required:
                raise LayoutSchemaError(f"{at}: field {name!r} is missing")
            continue
        values[field_name] = _value(hint, data[field_name], at, name)
    return cls(**values)


class _Mismatch(Exception):
    """The compiled reader met something it does not take (the checked reading then says what)."""


def _exactly(kind: type) -> Callable[[Any], Any]:
    def read(value: Any) -> Any:
        if type(value) is not kind:  # a bool is no int here; a subclass goes to the checked reading
            raise _Mismatch
        return value
    return read


def _as_is(value: Any) -> Any:
    return value


@functools.cache
def _reader(hint: Any) -> Callable[[Any], Any]:
    """A reader of JSON values of type `hint` (a field's type hint) that takes exactly what _value accepts
    and raises _Mismatch on anything else, compiled once per hint: a layout.json of an 8-rank run holds
    thousands of values, which _value's per-value hint inspection and field paths made the harness's
    largest cost per cell."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        read_inner = _reader(inner)
        return lambda value: None if value is None else read_inner(value)
    if is_dataclass(hint):
        return _object_reader(hint)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            read_item = _reader(args[0])

            def read_many(value: Any) -> tuple[Any, ...]:
                if type(value) is not list:
                    raise _Mismatch
                return tuple(map(read_item, value))
            return read_many
        readers = tuple(_reader(a) for a in args)

        def read_fixed(value: Any) -> tuple[Any, ...]:
            if type(value) is not list or len(value) != len(readers):
                raise _Mismatch
            return tuple(read(v) for read, v in zip(readers, value))
        return read_fixed
    if origin is dict:
        read_value = _reader(args[1])

        def read_map(value: Any) -> dict[str, Any]:
            if type(value) is not dict:
                raise _Mismatch
            return {str(k): read_value(v) for k, v in value.items()}
        return read_map
    if hint is int or hint is str:
        return _exactly(hint)
    return _as_is


def _object_reader(cls: type) -> Callable[[Any], Any]:
    schema = _schema(cls)
    readers = tuple((name, _reader(hint), required) for name, hint, required in schema.fields)

    def read_object(value: Any) -> Any:
        if type(value) is not dict or not schema.known.issuperset(value):
            raise _Mismatch
        values: dict[str, Any] = {}
        for name, read, required in readers:
            if name in value:
                values[name] = read(value[name])
            elif required:
                raise _Mismatch
        return cls(**values)
    return read_object


@dataclass(frozen=True)
class _Schema:
    """A dataclass's fields as _from_json reads them: (name, type hint, required) in order, and their names."""

    fields: tuple[tuple[str, Any, bool], ...]
    known: frozenset[str]


@functools.cache
def _schema(cls: type) -> _Schema:
    """`cls`'s fields and resolved type hints, once per class (resolving the hints is most of a parse's cost)."""
    hints = get_type_hints(cls)
    own = tuple((f.name, hints[f.name], f.default is MISSING) for f in fields(cls))
    return _Schema(fields=own, known=frozenset(name for name, _, _ in own))


def _value(hint: Any, value: Any, at: str, name: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, at, name)
    if is_dataclass(hint):
        return _from_json(hint, value, at, f"{name}.")
    if origin is tuple:
        if not isinstance(value, list):
            raise LayoutSchemaError(f"{at}: field {name!r} is {_kind(value)}, expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, at, f"{name}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise LayoutSchemaError(f"{at}: field {name!r} has {len(value)} values, expected {len(args)}")
        return tuple(_value(a, v, at, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise LayoutSchemaError(f"{at}: field {name!r} is {_kind(value)}, expected an object")
        return {str(k): _value(args[1], v, at, f"{name}[{k!r}]") for k, v in value.items()}
    if hint is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise LayoutSchemaError(f"{at}: field {name!r} is {value!r} ({_kind(value)}), expected an integer")
    if hint is str and not isinstance(value, str):
        raise LayoutSchemaError(f"{at}: field {name!r} is {value!r} ({_kind(value)}), expected a string")
    return value
