"""Servers the user runs (`harness run --attach TOPO=URL`): probed before the run (something answers the health
path, and the model, parallel layout and context length the server reports match the run's: a harness serve's
/server_info, SGLang's /get_server_info and /get_model_info, vLLM's /v1/models), and waited for during the run only
briefly, so a server that is gone is reported as the attached server's death within seconds."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from harness.backends.http.server import Server, ServerError
from harness.specs.topology import parse_topology_name

ATTACHED_READY_S = 10.0   # an attached server not healthy this long after a run asks for it is reported dead
PROBE_TIMEOUT_S = 5.0     # one probe request before the run
# SGLang's /get_server_info (its ServerArgs) field per topology axis: the axes it reports and the harness compares
SGLANG_SIZES: tuple[tuple[str, str], ...] = (("tp", "tp_size"), ("dcp", "dcp_size"), ("dp", "dp_size"),
                                             ("ep", "ep_size"))


@dataclass(frozen=True)
class Served:
    """What an attached server says it serves; None or () where it does not say."""
    engine: str                          # how it answered: "harness serve", "SGLang", "vLLM", ...
    source: str                          # the endpoint(s) that said it
    models: tuple[str, ...] = ()         # the model names it answers to
    model_path: str | None = None        # where it loaded the weights from (named in the message)
    topology: str | None = None          # a harness serve's topology name
    sizes: tuple[tuple[str, int], ...] = ()  # (axis, size) for the axes it reports (SGLang)
    max_model_len: int | None = None     # its longest sequence (prompt + generated tokens)


def _json(client: httpx.Client, path: str) -> Any:
    """`path`'s JSON body, or None when it is not 200 or not JSON (an engine without that endpoint)."""
    answer = client.get(path)
    if answer.status_code != 200:
        return None
    try:
        return answer.json()
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _harness_serve(client: httpx.Client) -> Served | None:
    info = _json(client, "/server_info")
    if not isinstance(info, dict) or info.get("engine") != "harness-serve":
        return None
    topo, model = info.get("topology"), info.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    return Served("harness serve", "/server_info", models=(name,) if isinstance(name, str) else (),
                  topology=topo.get("name") if isinstance(topo, dict) and isinstance(topo.get("name"), str) else None)


def _sglang(client: httpx.Client) -> Served | None:
    """SGLang: /get_server_info is its ServerArgs (served_model_name, model_path, tp_size, dp_size, ep_size,
    dcp_size, context_length, ...) plus its scheduler's info; /get_model_info names the model_path it loaded."""
    info = _json(client, "/get_server_info")
    if not isinstance(info, dict) or _int(info.get("tp_size")) is None:
        return None
    model_info = _json(client, "/get_model_info")
    path = model_info.get("model_path") if isinstance(model_info, dict) else info.get("model_path")
    name = info.get("served_model_name")
    sizes = tuple((axis, size) for axis, field in SGLANG_SIZES if (size := _int(info.get(field))) is not None)
    return Served("SGLang", "/get_server_info", models=(name,) if isinstance(name, str) else (),
                  model_path=path if isinstance(path, str) else None, sizes=sizes,
                  max_model_len=_int(info.get("context_length")))


def _openai_models(client: httpx.Client) -> Served | None:
    """vLLM (or another OpenAI-compatible server): /v1/models lists the served model names (`id`), each with the
    path it loaded (`root`) and vLLM's max_model_len. vLLM reports no parallel sizes there (nor in /metrics)."""
    listing = _json(client, "/v1/models")
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
        return None
    vllm = any(c.get("owned_by") == "vllm" for c in cards)
    lengths = [n for c in cards if (n := _int(c.get("max_model_len"))) is not None]
    roots = [c["root"] for c in cards if isinstance(c.get("root"), str)]
    return Served("vLLM" if vllm else "an OpenAI-compatible server", "/v1/models",
                  models=tuple(c["id"] for c in cards), model_path=roots[0] if roots else None,
                  max_model_len=min(lengths) if lengths else None)


def served_by(client: httpx.Client) -> Served | None:
    """What the server behind `client` says it serves, from the first of a harness serve's, SGLang's or an
    OpenAI-compatible (vLLM) server's endpoints that answers; None when none does."""
    for reader in (_harness_serve, _sglang, _openai_models):
        served = reader(client)
        if served is not None:
            return served
    return None


def mismatch(served: Served, topology: str, models: tuple[str, ...], max_seq_len: int) -> str | None:
    """Why `served` cannot serve `topology` for `models` at `max_seq_len` tokens, or None (as far as it says)."""
    where = f"({served.engine} {served.source})"
    if served.models and models and not set(served.models) & set(models):
        path = f" from {served.model_path}" if served.model_path and served.model_path not in served.models else ""
        return (f"it serves model {', '.join(served.models)}{path} {where}, this run's model is "
                f"{', '.join(models)}")
    if served.topology is not None and served.topology != topology:
        return f"it serves topology {served.topology}, not {topology} {where}"
    wanted = parse_topology_name(topology)
    wrong = [f"{axis}={size}" for axis, size in served.sizes if size != getattr(wanted, axis)]
    if wrong:
        need = ", ".join(f"{axis}={getattr(wanted, axis)}" for axis, _ in served.sizes)
        return f"it runs {', '.join(wrong)} {where}, topology {topology} needs {need}"
    if served.max_model_len is not None and max_seq_len and served.max_model_len < max_seq_len:
        return (f"its max_model_len is {served.max_model_len} tokens {where}, this run's sequences need "
                f"{max_seq_len} (--max-seq-len)")
    return None


def probe_attached(topology: str, url: str, health: str, models: tuple[str, ...], max_seq_len: int = 0) -> str | None:
    """Why the server at `url` cannot serve `topology` for `models`, or None when it can (as far as it says):
    nothing answers, the health path is not 200, or what it reports (served_by) is another model, topology or a
    shorter context than the run's --max-seq-len (mismatch)."""
    try:
        with httpx.Client(base_url=url, timeout=PROBE_TIMEOUT_S) as client:
            answer = client.get(health)
            if answer.status_code != 200:
                return f"{health} answered HTTP {answer.status_code}, not 200"
            served = served_by(client)
    except httpx.TransportError as exc:
        return f"nothing answers there ({type(exc).__name__}: {exc or 'no answer'})"
    return None if served is None else mismatch(served, topology, models, max_seq_len)


def wait_attached(server: Server, health: str, timeout_s: float = ATTACHED_READY_S) -> float:
    """Seconds until the attached server's health path answers 200; one that does not within `timeout_s` (it was
    stopped, or died mid-run) is a ServerError that says so: the harness did not start it and cannot restart it."""
    start = time.monotonic()
    last = "no answer"
    with httpx.Client(base_url=server.base_url, timeout=min(5.0, timeout_s)) as client:
        while True:
            try:
                code = client.get(health).status_code
                if code == 200:
                    return time.monotonic() - start
                last = f"HTTP {code}"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc or 'no answer'}"
            if time.monotonic() - start > timeout_s:
                raise ServerError(f"attached server {server.base_url} (--attach) is gone: {health} has not answered "
                                  f"200 for {timeout_s:.0f} s ({last}); the harness did not start it and does not "
                                  f"restart it", "")
            time.sleep(0.2)
