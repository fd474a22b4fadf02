"""`harness list [suites|topologies|models|faults|engines|checks|workloads]`."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from harness.checks.settings import load_suite
from harness.formats.locate import load_model
from harness.specs.loader import load_yaml
from harness.specs.model import shipped_models
from harness.specs.suite import shipped_suites
from harness.specs.topology import GRAMMAR, load_catalog
from harness.specs.workload import WORKLOADS


def add_parser(sub: Any) -> None:
    p = sub.add_parser("list", help="list shipped suites, topologies, models, faults, engines, checks or workloads")
    p.add_argument("what", nargs="?", default="all", choices=("all", *SECTIONS))
    p.set_defaults(func=run)


def _suites() -> list[str]:
    out = []
    for name in shipped_suites():
        s = load_suite(name)
        out.append(f"{name:<12} v{s.version}  models={','.join(s.models)}  topologies={','.join(s.topologies)}"
                   f"  {s.description}")
    return out


def _topologies() -> list[str]:
    cat = load_catalog()
    out = [f"{name:<16} {t.canonical_name}" for name, t in cat.topologies.items()]
    out += [f"{name:<16} set: {', '.join(members)}" for name, members in cat.sets.items()]
    out.append(f"(any {GRAMMAR} name works without being listed)")
    return out


def _models() -> list[str]:
    out = []
    for name, path in shipped_models().items():
        m = load_model(name)
        note = (load_yaml(path) or {}).get("source", "synthetic")
        out.append(f"{name:<14} heads={m.heads} kv={m.kv_heads} head_dim={m.head_dim} hidden={m.hidden} "
                   f"layers={m.layers} vocab={m.vocab} dtype={m.dtype} source={note}")
    return out


def _faults() -> list[str]:
    try:
        from harness.engine.faults import FAULTS, LOAD_CONDITIONS
    except ModuleNotFoundError:
        return ["(no engine installed)"]
    return ([f"{f.name:<18} [{f.check}] {f.description}" for f in FAULTS.values()]
            + [f"{name:<18} [load condition, a correct engine passes] {what}"
               for name, what in LOAD_CONDITIONS.items()])


def _engines() -> list[str]:
    from harness.backends.registry import available, get_backend
    from harness.core.errors import ConfigError
    from harness.specs.engine import load_engine

    out = []
    for name, info in available().items():
        head = f"{name:<20} [{info.origin}]"
        if info.template:  # an engine template: what it is, even when this machine cannot start it
            try:
                head += f" {load_engine(info.template).description};"
            except ConfigError as exc:
                out.append(f"{head} {exc}")
                continue
        try:
            backend = get_backend(name)
        except ConfigError as exc:  # a backend that needs an option (replay:DIR) is listed without an instance
            out.append(f"{head} {exc}")
            continue
        caps = backend.capabilities()
        out.append(f"{head} version={backend.version()} noise={backend.noise_strategy()} "
                   f"top_k={caps.top_k} provides={','.join(sorted(caps.provides))}")
    out.append("(an engine template that is not shipped runs by its path: --engine PATH.yaml[:OPTION])")
    return out


def _checks() -> list[str]:
    from harness.checks.catalog import registered_checks

    out = [f"{'check':<18} {'suite checks: key':<28} {'cells':<12} {'needs':<44} what it compares"]
    for spec in registered_checks():
        section = spec.section + ("" if spec.settings is not None else " (enabled)")
        out.append(f"{spec.name:<18} {section:<28} {spec.cells:<12} {spec.needs():<44} {spec.description}")
    out.append("(an engine lacking a need makes the check a SKIP with the reason; "
               "checks: {KEY: {enabled: false}} switches a key's checks off)")
    return out


def _workloads() -> list[str]:
    out = [f"{w.name:<16} sends {w.sends()}; {w.description}" for w in WORKLOADS.values()]
    users = {name: load_suite(name).workloads for name in shipped_suites()}
    out += [f"(suite {name}: {', '.join(names)})" for name, names in users.items() if len(names) > 1]
    out.append("(harness run --workload NAME[,NAME] picks some; long_context is the suite's, 136 tokens by default)")
    return out


SECTIONS: dict[str, Callable[[], list[str]]] = {
    "suites": _suites, "topologies": _topologies, "models": _models, "faults": _faults, "engines": _engines,
    "checks": _checks, "workloads": _workloads}


def run(args: argparse.Namespace) -> int:
    names = list(SECTIONS) if args.what == "all" else [args.what]
    for name in names:
        if len(names) > 1:
            print(f"# {name}")
        print("\n".join(SECTIONS[name]()))
    return 0
