"""Backends by name: the built-ins, one HTTP engine per template in engines/, and any package's entry
points in the group `harness.backends`.

An engine name is `NAME` or `NAME:OPTION` (e.g. `replay:reports/run-1`); the part after the first
colon is passed to the backend's factory. A shipped HTTP engine is its template, engines/NAME.yaml,
and nothing else: the file's stem is the engine's name. An engine template that is not shipped runs
by its path, `PATH.yaml` or `PATH.yaml:OPTION` (a value whose name part ends in .yaml or .yml).
A template's OPTION keeps the HTTP backend's meaning (the URL of a running server, for templates
that attach).

A factory is any callable `factory(option: str | None) -> Backend` (a Backend class taking one
optional argument works). A third-party package registers one in its pyproject.toml:

    [project.entry-points."harness.backends"]
    myengine = "my_package.harness_backend:MyBackend"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness.core.errors import ConfigError
from harness.core.plugins import load_target, registered
from harness.records.contract import Backend
from harness.specs.engine import ENGINES_DIR, shipped_engines
from harness.specs.loader import did_you_mean

ENTRY_POINT_GROUP = "harness.backends"
DEFAULT_ENGINE = "embedded"
TEMPLATE_SUFFIXES: tuple[str, ...] = (".yaml", ".yml")
# the backend of every engine template: called as HttpBackend(template path, option)
HTTP_BACKEND = "harness.backends.http.backend:HttpBackend"

Factory = Callable[[str | None], Backend]
TemplateFactory = Callable[[str, str | None], Backend]

# the backends that are not an engine template: name -> "module:attribute" of a factory, imported only when asked for
BUILTIN: dict[str, str] = {
    "embedded": "harness.backends.embedded.backend:EmbeddedBackend",
    "embedded-topk": "harness.backends.embedded.backend:TopkOnlyBackend",
    "replay": "harness.backends.replay:ReplayBackend",
}


@dataclass(frozen=True)
class BackendInfo:
    """Where a backend comes from. `origin`: `builtin`, the template file (`engines/NAME.yaml`, or the
    path given) or the distribution that registered it. `template`: the engine template's path, for an
    HTTP engine (its target is then called with the template and the option)."""

    name: str
    target: str
    origin: str
    template: str = ""


def available(folder: Path = ENGINES_DIR) -> dict[str, BackendInfo]:
    """Every backend name: the built-ins, then one per template in `folder` (engines/), then entry
    points; a later one never shadows an earlier one."""
    out = {name: BackendInfo(name, target, "builtin") for name, target in BUILTIN.items()}
    for name, path in shipped_engines(folder).items():
        out.setdefault(name, BackendInfo(name, HTTP_BACKEND, f"{folder.name}/{path.name}", str(path)))
    for entry in registered(ENTRY_POINT_GROUP):
        out.setdefault(entry.name, BackendInfo(entry.name, entry.target, entry.origin))
    return out


def split_engine(engine: str) -> tuple[str, str | None]:
    """'replay:DIR' -> ('replay', 'DIR'); 'embedded' -> ('embedded', None); 'x.yaml:URL' -> ('x.yaml', 'URL')."""
    name, sep, option = engine.partition(":")
    return name, (option if sep else None)


def is_template_path(name: str) -> bool:
    """Whether an engine name (the part before the option) is the path of an engine template."""
    return Path(name).suffix in TEMPLATE_SUFFIXES


def engine_info(name: str, folder: Path = ENGINES_DIR) -> BackendInfo:
    """The backend `name` (a registered name or a template's path) refers to; a ConfigError if none."""
    if is_template_path(name):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"engine template {name} does not exist (--engine PATH.yaml[:OPTION] names an "
                              f"engine template file; shipped ones: harness list engines)")
        return BackendInfo(path.stem, HTTP_BACKEND, name, str(path))
    known = available(folder)
    if name not in known:
        raise ConfigError(f"unknown engine {name!r}{did_you_mean(name, tuple(known))}; "
                          f"valid: {', '.join(known)} or an engine template PATH.yaml (harness list engines)")
    return known[name]


def get_backend(engine: str = DEFAULT_ENGINE, folder: Path = ENGINES_DIR) -> Backend:
    """The backend for `engine` (`NAME`, `NAME:OPTION`, `PATH.yaml` or `PATH.yaml:OPTION`); an unknown
    name or a missing template is a ConfigError."""
    name, option = split_engine(engine)
    info = engine_info(name, folder)
    if info.template:
        template_factory: TemplateFactory = load_target(info.target)
        backend = template_factory(info.template, option)
    else:
        factory: Factory = load_target(info.target)
        backend = factory(option)
    if not isinstance(backend, Backend):
        raise ConfigError(f"engine {name!r} ({info.target}) does not implement harness.records.contract.Backend "
                          f"(subclass it: it supplies the defaults of the optional methods engine_build, engine_env "
                          f"and engine_fault)")
    return backend
