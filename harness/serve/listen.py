"""The listening socket of `harness serve`, bound before the server starts: a port that is taken or a
host that does not resolve is one ListenError (`cannot listen on HOST:PORT: <reason>`, CLI exit 2),
never a server thread that dies while the ranks wait for requests that cannot come."""

from __future__ import annotations

import socket

from harness.core.errors import ConfigError


class ListenError(ConfigError):
    """The server's address cannot be bound (port taken, host unknown or not this machine's)."""


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one (SO_REUSEADDR, so a port in TIME_WAIT is
    free), not yet listening: connections are refused until the server listens on it."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
    except OSError as exc:  # gaierror included: a host that does not resolve
        raise ListenError(f"cannot listen on {address(host, port)}: {exc.strerror or exc}") from exc
    return sock


def check_listen(host: str, port: int) -> None:
    """Raise ListenError now if (host, port) cannot be bound (the socket is closed again)."""
    bind_socket(host, port).close()
