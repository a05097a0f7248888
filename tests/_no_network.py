"""A fixture that fails any test whose code opens a network connection or resolves a host name: the proof
that a served SDK call never leaves the process."""

import socket

import pytest


class NetworkUsed(AssertionError):
    """Raised by the patched socket functions: a request tried to leave the process."""


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connect and name lookup raises `NetworkUsed`, and is counted in the returned list."""
    attempts: list[str] = []

    def refuse(what):
        def blocked(*args, **kwargs):
            attempts.append(f"{what} {args[1:] if what.startswith('socket.') else args}")
            raise NetworkUsed(f"{what} called: a request tried to leave the process ({args[1:]})")
        return blocked

    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    yield attempts


def child_guard(port: int) -> str:
    """Python source a child process runs first: every name lookup and socket connect raises `ConnectionError`
    (naming what was tried), except a connect to 127.0.0.1:`port`, the run's local endpoint. The proof that a
    subprocess's served call never leaves the machine."""
    return f"""
import socket as _socket
_ALLOWED = ("127.0.0.1", {port})
_connect = _socket.socket.connect

def _only_the_endpoint(self, address):
    if tuple(address[:2]) != _ALLOWED:
        raise ConnectionError(f"blocked: a connect to {{address}} tried to leave the machine (only {{_ALLOWED}})")
    return _connect(self, address)

def _no_lookup(host, *args, **kwargs):
    if host != "127.0.0.1":
        raise ConnectionError(f"blocked: a name lookup of {{host!r}} (only {{_ALLOWED}} may be reached)")
    return _lookup(host, *args, **kwargs)

_lookup = _socket.getaddrinfo
_socket.socket.connect = _only_the_endpoint
_socket.getaddrinfo = _no_lookup
"""
