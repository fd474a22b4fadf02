"""Servers the user runs (`harness run --attach TOPO=URL`): probed before the run (something answers the health
path; a harness serve's /server_info names the topology and model it serves), and waited for during the run only
briefly, so a server that is gone is reported as the attached server's death within seconds."""

from __future__ import annotations

import time
from typing import Any

import httpx

from harness.backends.http.server import Server, ServerError

ATTACHED_READY_S = 10.0   # an attached server not healthy this long after a run asks for it is reported dead
PROBE_TIMEOUT_S = 5.0     # one probe request before the run


def probe_attached(topology: str, url: str, health: str, models: tuple[str, ...]) -> str | None:
    """Why the server at `url` cannot serve `topology` for `models`, or None when it can (as far as it says):
    nothing answers, the health path is not 200, or a harness serve's /server_info names another topology or
    model. Servers without /server_info (vLLM, SGLang) are checked for health only."""
    try:
        with httpx.Client(base_url=url, timeout=PROBE_TIMEOUT_S) as client:
            answer = client.get(health)
            if answer.status_code != 200:
                return f"{health} answered HTTP {answer.status_code}, not 200"
            info = client.get("/server_info")
            served: Any = info.json() if info.status_code == 200 else None
    except httpx.TransportError as exc:
        return f"nothing answers there ({type(exc).__name__}: {exc or 'no answer'})"
    except ValueError:  # /server_info is not JSON: not a harness serve
        return None
    if not isinstance(served, dict) or served.get("engine") != "harness-serve":
        return None
    topo = (served.get("topology") or {}).get("name") if isinstance(served.get("topology"), dict) else None
    model = (served.get("model") or {}).get("name") if isinstance(served.get("model"), dict) else None
    if model is not None and models and model not in models:
        return f"it serves model {model}, this run's model is {', '.join(models)}"
    if topo is not None and topo != topology:
        return f"it serves topology {topo}, not {topology}"
    return None


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
