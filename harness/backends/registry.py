"""Backends by name: the built-ins and any package's entry points in the group `harness.backends`.

An engine name is `NAME` or `NAME:OPTION` (e.g. `replay:reports/run-1`); the part after the first
colon is passed to the backend's factory. A factory is any callable `factory(option: str | None)
-> Backend` (a Backend class taking one optional argument works). A third-party package registers
one in its pyproject.toml:

    [project.entry-points."harness.backends"]
    myengine = "my_package.harness_backend:MyBackend"
"""

from __future__ import annotations

from typing import Callable

from harness.contract import Backend
from harness.errors import ConfigError
from harness.plugins import Registered, load_target, registered
from harness.specs.loader import did_you_mean

ENTRY_POINT_GROUP = "harness.backends"
DEFAULT_ENGINE = "embedded"

Factory = Callable[[str | None], Backend]

# name -> "module:attribute" of a factory; imported only when asked for
BUILTIN: dict[str, str] = {
    "embedded": "harness.backends.embedded:EmbeddedBackend",
    "embedded-topk": "harness.backends.embedded:TopkOnlyBackend",
    "replay": "harness.backends.replay:ReplayBackend",
    # HTTP engines, one per shipped template in engines/ (harness/backends/http.py)
    "harness-serve": "harness.backends.http:harness_serve",
    "harness-serve-sglang": "harness.backends.http:harness_serve_sglang",
    "vllm": "harness.backends.http:vllm",
    "sglang": "harness.backends.http:sglang",
    "openai": "harness.backends.http:openai",
}


BackendInfo = Registered  # where a backend comes from: `builtin` or the distribution that registered it


def available() -> dict[str, BackendInfo]:
    """Every backend name, built-ins first; an entry point never shadows a built-in."""
    out = {name: BackendInfo(name, target, "builtin") for name, target in BUILTIN.items()}
    for entry in registered(ENTRY_POINT_GROUP):
        out.setdefault(entry.name, entry)
    return out


def split_engine(engine: str) -> tuple[str, str | None]:
    """'replay:DIR' -> ('replay', 'DIR'); 'embedded' -> ('embedded', None)."""
    name, sep, option = engine.partition(":")
    return name, (option if sep else None)


def get_backend(engine: str = DEFAULT_ENGINE) -> Backend:
    """The backend for `engine` (`NAME` or `NAME:OPTION`); an unknown name is a ConfigError."""
    name, option = split_engine(engine)
    known = available()
    if name not in known:
        raise ConfigError(f"unknown engine {name!r}{did_you_mean(name, tuple(known))}; "
                          f"valid: {', '.join(known)} (harness list engines)")
    factory: Factory = load_target(known[name].target)
    backend = factory(option)
    if not isinstance(backend, Backend):
        raise ConfigError(f"engine {name!r} ({known[name].target}) does not implement harness.contract.Backend")
    return backend
