"""Topology: how one run splits the model (tp, dcp, speculator). Parsed from names and YAML."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from harness.core.errors import ConfigError
from harness.core.paths import TOPOLOGIES_DIR
from harness.partition.layout import ROUND_ROBIN, Placement
from harness.specs.loader import check_keys, check_path_name, did_you_mean, expect_int, expect_mapping, load_yaml

SPECULATORS: tuple[str, ...] = ("none", "draft", "mtp")
_NAME_RE = re.compile(r"^tp(?P<tp>\d+)(?:dcp(?P<dcp>\d+)(?:i(?P<interleave>\d+)|(?P<contiguous>c))?(?P<q>q)?)?"
                      r"(?:dp(?P<dp>\d+))?(?:ep(?P<ep>\d+))?(?:-(?P<spec>[a-z]+))?$")
LAYOUT_GRAMMAR = "tp<N>[dcp<M>[i<K>|c][q]][dp<D>][ep<E>]"
PD_SEP = ">"  # prefill layout > decode layout (disaggregated prefill/decode)
GRAMMAR = f"{LAYOUT_GRAMMAR}[-draft|-mtp] | {LAYOUT_GRAMMAR}{PD_SEP}{LAYOUT_GRAMMAR}"
PD_GRAMMAR = (f"PREFILL{PD_SEP}DECODE[-draft], each side {LAYOUT_GRAMMAR}, the decode side optionally with a draft "
              "speculator, e.g. tp4>tp2dcp2 (prefill on tp4, its KV moved to a tp2dcp2 decode world) or tp2>tp2-draft")
NAME_GRAMMAR = (f"{GRAMMAR}, e.g. tp1, tp4, tp4dcp4, tp4dcp4i16 (DCP tokens "
                "interleaved in chunks of 16), tp4dcp4c (contiguous blocks per sequence), tp4dcp4q (Q replicated "
                "in the DCP group), tp4dcp2ep4 (experts over 4 ranks), tp4dp4ep4 (attention data parallel: 4 DP "
                "ranks, each with its own requests, experts over all 4), tp8dcp2-mtp, tp4-draft, tp4>tp2dcp2 "
                "(disaggregated: prefill on tp4, decode on tp2dcp2)")
PLACEMENT_KEYS: tuple[str, ...] = ("interleave", "contiguous", "q_replicated")
OPTION_KEYS: tuple[str, ...] = (*PLACEMENT_KEYS, "ep", "dp")  # written only when they differ from their defaults


TOPOLOGY_AXES: tuple[str, ...] = ("dcp", "ep", "dp", "speculator", "pd")  # Topology.axes


@dataclass(frozen=True)
class Topology:
    """One parallel configuration. World size = tp; dcp splits each TP group's tokens; ep splits the
    experts of MoE layers over ep ranks inside the world (each expert's columns over tp // ep ranks,
    harness/partition/hybrid_layout.py); dp splits the requests: attention data parallel, dp ranks each run
    the attention (and dense layers) of their own requests with the whole attention weights (attention TP
    inside a DP rank is tp // dp = 1), and the MoE layers run over expert parallel across the world."""

    tp: int
    dcp: int = 1
    speculator: str = "none"
    name: str = ""
    interleave: int = 1         # DCP tokens dealt in chunks of this many (1: round-robin)
    contiguous: bool = False    # DCP tokens in contiguous blocks per sequence (layout.Placement)
    q_replicated: bool = False  # MLA: q_b_proj / w_kc of the whole DCP group on every rank, no Q gather
    ep: int = 1                 # expert parallel ranks (MoE experts split over ep ranks of the world)
    dp: int = 1                 # attention data parallel ranks (each with its own requests)
    prefill: Topology | None = None  # disaggregated: the prefill world's layout (this one is the decode world's)

    def __post_init__(self) -> None:
        where = f"topology {self.name or '?'}"
        if self.name:  # names run folders and cache entries (a grammar name is always one)
            check_path_name(where, "name", self.name)
        expect_int(where, "tp", self.tp, minimum=1)
        expect_int(where, "dcp", self.dcp, minimum=1)
        expect_int(where, "interleave", self.interleave, minimum=1)
        if self.tp % self.dcp:
            raise ConfigError(f"{where}: dcp={self.dcp} does not divide tp={self.tp}; "
                              f"valid dcp values: {divisors(self.tp)}")
        expect_int(where, "ep", self.ep, minimum=1)
        if self.tp % self.ep:
            raise ConfigError(f"{where}: ep={self.ep} does not divide the world (tp={self.tp}); "
                              f"valid ep values: {divisors(self.tp)}")
        expect_int(where, "dp", self.dp, minimum=1)
        if self.dp > 1 and self.dp != self.tp:
            raise ConfigError(f"{where}: dp={self.dp} with tp={self.tp}: attention data parallel runs one DP rank "
                              f"per rank of the world (attention TP inside a DP rank, tp // dp = {self.tp // self.dp}"
                              f" ranks, is not supported); valid: dp=tp, e.g. tp{self.tp}dp{self.tp}ep{self.tp}")
        if self.dp > 1 and self.dcp > 1:
            raise ConfigError(f"{where}: dp={self.dp} with dcp={self.dcp}: a DP rank's attention holds its requests' "
                              f"whole KV cache (no DCP inside a DP rank); valid: dcp=1 with dp > 1")
        for key in ("contiguous", "q_replicated"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{where}: {key}={getattr(self, key)!r} must be true or false")
        if self.contiguous and self.interleave != 1:
            raise ConfigError(f"{where}: a DCP placement is interleaved (i{self.interleave}) or contiguous (c), "
                              f"not both")
        if self.dcp == 1 and (self.interleave != 1 or self.contiguous or self.q_replicated):
            raise ConfigError(f"{where}: the DCP suffixes i<K>, c and q need dcp > 1 (got dcp=1); "
                              f"e.g. tp{self.tp}dcp{self.tp}i16")
        if self.speculator not in SPECULATORS:
            raise ConfigError(f"{where}: speculator={self.speculator!r} is not one of "
                              f"{', '.join(SPECULATORS)}{did_you_mean(self.speculator, SPECULATORS)}")
        if self.prefill is not None:
            self._check_pd(where)
        if not self.name:
            object.__setattr__(self, "name", self.canonical_name)

    def _check_pd(self, where: str) -> None:
        """A disaggregated pair: two layouts without speculators, neither contiguous, no nesting."""
        pre = self.prefill
        if not isinstance(pre, Topology) or pre.prefill is not None:
            raise ConfigError(f"{where}: prefill={pre!r} must be one plain layout; expected {PD_GRAMMAR}")
        if pre.speculator != "none":
            raise ConfigError(f"{where}: the prefill layout has speculator {pre.speculator!r}; the speculator runs in "
                              f"the decode world (e.g. tp2>tp2-draft); expected {PD_GRAMMAR}")
        if self.speculator not in ("none", "draft"):
            raise ConfigError(f"{where}: the decode layout has speculator {self.speculator!r}; a disaggregated "
                              f"topology takes -draft (its own cache computed on the decode side), not -mtp (its "
                              f"catch-up needs the prompt's hidden states, which the connector does not move); "
                              f"expected {PD_GRAMMAR}")
        for side, topo in (("prefill", pre), ("decode", self)):
            if topo.dp > 1:
                raise ConfigError(f"{where}: the {side} layout has dp={topo.dp}; the KV connector moves one "
                                  f"world's KV, not a DP rank's own requests; expected {PD_GRAMMAR} with dp=1")
            if topo.contiguous:
                raise ConfigError(f"{where}: the {side} layout's DCP placement is contiguous (c); a disaggregated "
                                  f"topology takes round-robin or interleaved (i<K>) placements: a contiguous "
                                  f"owner depends on the sequence's first forward, which the decode side never runs; "
                                  f"expected {PD_GRAMMAR}")

    @property
    def axes(self) -> tuple[str, ...]:
        """The parallel axes this layout (and a disaggregated topology's prefill layout) uses beyond plain TP, in
        TOPOLOGY_AXES order: what an engine template can declare it cannot run (unsupported_axes)."""
        used = {"dcp": self.dcp > 1, "ep": self.ep > 1, "dp": self.dp > 1,
                "speculator": self.speculator != "none", "pd": self.prefill is not None}
        pre = self.prefill.axes if self.prefill is not None else ()
        return tuple(a for a in TOPOLOGY_AXES if used[a] or a in pre)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def placement(self) -> Placement:
        """How the DCP group deals tokens to its ranks (layout.token_owner)."""
        return Placement("contiguous") if self.contiguous else (
            Placement("interleave", self.interleave) if self.interleave != 1 else ROUND_ROBIN)

    @property
    def dcp_suffix(self) -> str:
        """i<K> / c, then q: the DCP placement and Q mode as the name spells them ('' for the defaults)."""
        return ((f"i{self.interleave}" if self.interleave != 1 else "") + ("c" if self.contiguous else "")
                + ("q" if self.q_replicated else ""))

    @property
    def canonical_name(self) -> str:
        base = (f"tp{self.tp}" + (f"dcp{self.dcp}{self.dcp_suffix}" if self.dcp > 1 else "")
                + (f"dp{self.dp}" if self.dp > 1 else "") + (f"ep{self.ep}" if self.ep > 1 else ""))
        if self.prefill is not None:
            base = f"{self.prefill.canonical_name}{PD_SEP}{base}"
        return base + ("" if self.speculator == "none" else f"-{self.speculator}")

    def without_speculator(self) -> "Topology":
        return Topology(tp=self.tp, dcp=self.dcp, prefill=self.prefill, **self._options())

    def decode_layout(self) -> "Topology":
        """The decode world's own layout (this topology without its prefill side)."""
        return Topology(tp=self.tp, dcp=self.dcp, speculator=self.speculator, **self._options())

    def _options(self) -> dict[str, Any]:
        """The placement, Q-mode and expert-parallel fields that differ from their defaults (topologies
        without them keep their dict, and so their cache keys)."""
        return {k: getattr(self, k) for k in OPTION_KEYS
                if getattr(self, k) != Topology.__dataclass_fields__[k].default}

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "tp": self.tp, "dcp": self.dcp, "speculator": self.speculator,
               "world_size": self.world_size, **self._options()}
        if self.prefill is not None:  # only disaggregated topologies carry it (other cache keys unchanged)
            out["prefill"] = self.prefill.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "topology") -> Topology:
        """The topology `to_dict` wrote (its derived world_size, when present, must agree with tp)."""
        check_keys(where, data, ("name", "tp", "dcp", "speculator", "world_size", "prefill", *OPTION_KEYS), ("tp",))
        prefill = data.get("prefill")
        if prefill is not None and not isinstance(prefill, Mapping):
            raise ConfigError(f"{where}: prefill={prefill!r} must be a mapping (a topology); expected {PD_GRAMMAR}")
        topo = cls(tp=data["tp"], dcp=data.get("dcp", 1), speculator=data.get("speculator", "none"),
                   name=data.get("name", ""), prefill=None if prefill is None else cls.from_dict(
                       prefill, f"{where} prefill"),
                   **{k: data[k] for k in OPTION_KEYS if k in data})
        if "world_size" in data and data["world_size"] != topo.world_size:
            raise ConfigError(f"{where}: world_size={data['world_size']!r} is not tp={topo.tp}")
        return topo


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_topology_name(name: str) -> Topology:
    """Parse `tp4dcp4-mtp` style names, and `tp4>tp2dcp2` disaggregated pairs; raise naming the grammar on
    anything else."""
    if PD_SEP in name:
        return _parse_pd(name)
    match = _NAME_RE.match(name.strip())
    if not match:
        raise ConfigError(f"bad topology name {name!r}; expected {NAME_GRAMMAR}")
    spec = match.group("spec") or "none"
    if spec not in SPECULATORS or (match.group("spec") and spec == "none"):
        raise ConfigError(f"bad topology name {name!r}: speculator suffix -{spec} is not -draft or -mtp"
                          f"{did_you_mean(spec, ('draft', 'mtp'))}")
    return Topology(tp=int(match.group("tp")), dcp=int(match.group("dcp") or 1), speculator=spec,
                    name=name.strip(), interleave=int(match.group("interleave") or 1),
                    contiguous=bool(match.group("contiguous")), q_replicated=bool(match.group("q")),
                    ep=int(match.group("ep") or 1), dp=int(match.group("dp") or 1))


def _parse_pd(name: str) -> Topology:
    """`PREFILL>DECODE`: two plain layouts; the decode layout is the topology, the prefill one its `prefill`."""
    parts = name.strip().split(PD_SEP)
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ConfigError(f"bad disaggregated topology {name!r}: expected {PD_GRAMMAR}")
    sides = []
    for side, part in zip(("prefill", "decode"), parts):
        if not _NAME_RE.match(part.strip()):
            raise ConfigError(f"bad disaggregated topology {name!r}: the {side} layout {part!r} is not "
                              f"{LAYOUT_GRAMMAR}; expected {PD_GRAMMAR}")
        sides.append(parse_topology_name(part))
    pre, dec = sides
    return Topology(tp=dec.tp, dcp=dec.dcp, speculator=dec.speculator, name=name.strip(), prefill=pre,
                    **dec._options())


@dataclass(frozen=True)
class TopologyCatalog:
    """Named topologies and named sets from topologies/*.yaml."""

    topologies: Mapping[str, Topology]
    sets: Mapping[str, tuple[str, ...]]

    def resolve(self, expr: str, all_names: tuple[str, ...] = ()) -> list[Topology]:
        """Resolve `tp4,dcp-nightly,tp8dcp8` (or `all` = `all_names`) into unique topologies, in order."""
        out: dict[str, Topology] = {}
        items = [p.strip() for p in expr.split(",")]
        if not any(items):  # '', ' ', ','
            raise ConfigError(f"empty topology list {expr!r}; expected names or sets separated by commas")
        if "" in items:
            raise ConfigError(f"empty item in topology list {expr!r} (item {items.index('') + 1}); "
                              f"expected names or sets separated by single commas, e.g. tp2,tp4")
        for item in items:
            for topo in self._resolve_one(item, all_names, seen=()):
                out.setdefault(topo.canonical_name, topo)  # one run per configuration
        return list(out.values())

    def _resolve_one(self, item: str, all_names: tuple[str, ...], seen: tuple[str, ...]) -> list[Topology]:
        if item == "all":
            if not all_names:
                raise ConfigError("--topo all needs a suite whose topologies it means")
            return [t for name in all_names for t in self._resolve_one(name, (), seen)]
        if item in self.sets:
            if item in seen:
                raise ConfigError(f"topology set {item!r} includes itself")
            return [t for name in self.sets[item] for t in self._resolve_one(name, all_names, seen + (item,))]
        if item in self.topologies:
            return [self.topologies[item]]
        if _NAME_RE.match(item) or PD_SEP in item:
            return [parse_topology_name(item)]
        known = tuple(self.topologies) + tuple(self.sets)
        raise ConfigError(f"unknown topology or set {item!r}{did_you_mean(item, known)}; "
                          f"expected {NAME_GRAMMAR}, or a set: {', '.join(sorted(self.sets)) or '(none)'}")


def _topology_from_yaml(where: str, name: str, data: Any) -> Topology:
    if isinstance(data, str):
        return _renamed(parse_topology_name(data), name)
    check_keys(f"{where}: topology {name}", data, ("tp", "dcp", "speculator", *OPTION_KEYS), ("tp",))
    return Topology(name=name, **data)


def _renamed(topo: Topology, name: str) -> Topology:
    return Topology(tp=topo.tp, dcp=topo.dcp, speculator=topo.speculator, name=name, prefill=topo.prefill,
                    **topo._options())


def load_catalog(dirs: tuple[Path, ...] = (TOPOLOGIES_DIR,)) -> TopologyCatalog:
    """Read every topologies/*.yaml: keys `topologies: {name: {tp, dcp, speculator}}` and `sets: {name: [..]}`."""
    topologies: dict[str, Topology] = {}
    sets: dict[str, tuple[str, ...]] = {}
    for folder in dirs:
        for path in sorted(folder.glob("*.yaml")):
            data = load_yaml(path) or {}
            check_keys(str(path), data, ("topologies", "sets"))
            for name, body in expect_mapping(f"{path}: topologies", data.get("topologies") or {}).items():
                topologies[name] = _topology_from_yaml(str(path), name, body)
            for name, members in expect_mapping(f"{path}: sets", data.get("sets") or {}).items():
                if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
                    raise ConfigError(f"{path}: set {name!r} must be a list of topology names, got {members!r}")
                sets[name] = tuple(members)
    catalog = TopologyCatalog(topologies=topologies, sets=sets)
    for name, members in sets.items():
        for member in members:
            catalog.resolve(member)  # validates every member now, naming the bad one
    return catalog
