"""Project errors: every mistake a user can make raises one of these, with a message that says what to do.

A leaf module: it imports nothing of the project, so `cache`, `saes`, `probes`, `analyses` and
`app` all import it.

The app and the CLI catch `ThoughtscopeError` and show its message instead of a traceback;
the server turns it into a JSON error with a 4xx status.
"""

from __future__ import annotations


class ThoughtscopeError(Exception):
    """Base class of every error a user can cause. `str(err)` is meant for the user."""

    http_status = 400


class UnknownModelError(ThoughtscopeError):
    """The model id is not in the zoo, or its files are missing."""

    http_status = 404


class ModelLoadError(ThoughtscopeError):
    """The model files exist but could not be loaded."""

    http_status = 500


class UnknownSiteError(ThoughtscopeError):
    """A hook-site name that does not exist for this model."""


class BadInputError(ThoughtscopeError):
    """Empty or over-long prompt, bad slider value, NaN or wrong-width vector, malformed file."""


class CacheError(ThoughtscopeError):
    """The activation cache could not store or read an entry."""


# ----- errors only the model server and its client raise -----


class AuthError(ThoughtscopeError):
    """The server wants a bearer token and got none or a wrong one."""

    http_status = 401


class RequestTooLargeError(ThoughtscopeError):
    """The request body is over the server's size limit."""

    http_status = 413


class MemoryBudgetError(RequestTooLargeError):
    """A capture, trace or stream whose estimated memory is over the budget (probes.memory_budget),
    refused before any model work; the message carries the estimate, its parts and the budget."""


class InvalidRequestError(BadInputError):
    """The request body does not match the schema (wrong type, unknown field, value out of range)."""

    http_status = 422


class ServerBusyError(ThoughtscopeError):
    """The model's waiting room is full, or the model is still loading; retry after `retry_after` s."""

    http_status = 503

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class ServerError(ThoughtscopeError):
    """The server failed in a way the user did not cause, or could not be reached."""

    http_status = 500


class UnknownStateError(ThoughtscopeError):
    """A prefix-state id the model server does not hold (never made, freed, expired or evicted)."""

    http_status = 404


class ConflictError(ThoughtscopeError):
    """A request id already in use by a queued or running request."""

    http_status = 409


class TimeoutExceededError(ThoughtscopeError):
    """A request waited or ran longer than the server allows (queue wait, stream time, a stalled reader)."""

    http_status = 503


class RequestTimeoutError(ThoughtscopeError):
    """A client that stopped sending its request body part-way (the server's read timeout passed)."""

    http_status = 408


class ClusterError(ThoughtscopeError):
    """A Ray cluster that cannot be reached in time, lacks the resources asked for, or lost every model
    replica (analyses.distributed); the message says what to start or what to ask for instead."""

    http_status = 503
