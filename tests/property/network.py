"""The property suite's network guard (issue 47 item 6): while it is on, every socket connect and host-name
lookup is refused and counted, except a connect to the run's local endpoint on 127.0.0.1 (a port in
`clients.ENDPOINT_PORTS`, the one server a client is meant to reach). A call the instrumentation did not serve
shows up in `ATTEMPTS`, which the invariants require to stay empty."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any, NoReturn

from tests.property import clients

__all__ = ["ATTEMPTS", "NetworkUsed", "guarded"]

ATTEMPTS: list[str] = []
"""Every refused connect or lookup since the guard went on: 'what address'."""
_LOOPBACK = ("127.0.0.1", "localhost")


class NetworkUsed(AssertionError):
    """A request tried to leave the process."""


def _allowed(address: Any) -> bool:
    return (isinstance(address, tuple) and len(address) >= 2 and address[0] in _LOOPBACK
            and address[1] in clients.ENDPOINT_PORTS)


@contextlib.contextmanager
def guarded() -> Iterator[list[str]]:
    """Refuse and count every connect and lookup but the local endpoint's, until the block ends."""
    saved = (socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo, socket.create_connection)
    connect, connect_ex, getaddrinfo, create_connection = saved

    def refuse(what: str, address: Any) -> NoReturn:
        ATTEMPTS.append(f"{what} {address!r}")
        raise NetworkUsed(f"{what} {address!r}: a request tried to leave the process")

    def guarded_connect(self: socket.socket, address: Any) -> Any:
        return connect(self, address) if _allowed(address) else refuse("socket.connect", address)

    def guarded_connect_ex(self: socket.socket, address: Any) -> Any:
        return connect_ex(self, address) if _allowed(address) else refuse("socket.connect_ex", address)

    def guarded_getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if _allowed((host, port)):
            return getaddrinfo(host, port, *args, **kwargs)
        return refuse("getaddrinfo", (host, port))

    def guarded_create_connection(address: Any, *args: Any, **kwargs: Any) -> Any:
        return create_connection(address, *args, **kwargs) if _allowed(address) else refuse(
            "create_connection", address)

    socket.socket.connect, socket.socket.connect_ex = guarded_connect, guarded_connect_ex
    socket.getaddrinfo, socket.create_connection = guarded_getaddrinfo, guarded_create_connection
    try:
        yield ATTEMPTS
    finally:
        socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo, socket.create_connection = saved
