"""Errors of the served (HTTP) backends. All are `PolicyError`s, so a rollout records the episode as failed."""

from __future__ import annotations

from drmas_graph.errors import PolicyError

__all__ = ["ServerError", "ServerUnavailableError", "GenerationAbortedError", "BadRequestError",
           "WeightSyncError", "ServerStartError"]


class ServerError(PolicyError):
    """An inference server failed or answered something unusable; the message names the URL."""


class ServerUnavailableError(ServerError, ConnectionError):
    """The server could not be reached (refused, reset, timed out, 502/503/504) after every retry."""


class GenerationAbortedError(ServerError):
    """The server aborted the request (e.g. paused for a weight update). Retryable: send the request again."""

    retryable = True


class BadRequestError(ServerError, ValueError):
    """The server rejected the request (HTTP 400/422): an unknown sampling key, a bad body. Not retried."""


class WeightSyncError(ServerError):
    """A weight sync failed or the server reports another weights version than the one pushed."""


class ServerStartError(ServerError):
    """A launched server exited or did not become ready in time; the message ends with its log tail."""
