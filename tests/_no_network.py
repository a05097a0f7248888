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
