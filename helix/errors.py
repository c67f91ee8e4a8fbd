"""The one error hierarchy of Helix.

Every error a user can cause (a bad file, a bad request, a bad wire message, an impossible
plan) is a :class:`HelixError` subclass carrying the data that explains it. The CLI turns
these into a one-line message and a non-zero exit code; the HTTP layer into an OpenAI-style
error body with the subclass's ``http_status``.
"""

from __future__ import annotations


class HelixError(Exception):
    """Base class: a problem the user can act on, with a message that names what was wrong."""

    http_status: int = 500
    exit_code: int = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(HelixError):
    """A cluster, profile or plan file (or a CLI option) is invalid.

    ``source`` names the file (or option) and ``field`` the dotted path inside it.
    """

    http_status = 400
    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None) -> None:
        where = ""
        if source:
            where += f"{source}"
        if field:
            where += f"{': ' if where else ''}{field}"
        super().__init__(f"{where}: {message}" if where else message)
        self.source = source
        self.field = field
        self.detail = message


class InfeasiblePlanError(HelixError):
    """No placement can serve the model on this cluster (e.g. not enough memory for all layers)."""

    exit_code = 3


class NoRouteError(HelixError):
    """No complete pipeline is currently available (all masked, dead or overloaded)."""

    http_status = 503
    exit_code = 4


class OverloadedError(HelixError):
    """The bounded admission queue is full; the client should retry later."""

    http_status = 429

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestError(HelixError):
    """An HTTP request body or parameter is invalid (names the field)."""

    http_status = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ProtocolError(HelixError):
    """A wire message is malformed, unknown, oversized or of the wrong protocol version."""

    http_status = 502


class CapacityError(HelixError):
    """A request can never fit (e.g. its KV reservation exceeds a node's whole KV capacity)."""

    http_status = 400


class EngineError(HelixError):
    """The engine cannot run: missing weights, unsupported config, bad tensor shapes."""

    exit_code = 5


class PETError(HelixError):
    """A task's PET (parameter-efficient fine-tuning) parameters do not fit its base model.

    ``tensor`` names the offending tensor; ``source`` the file it came from, when it came from one.
    """

    http_status = 400

    def __init__(self, message: str, *, tensor: str | None = None, source: str | None = None) -> None:
        where = ": ".join(part for part in (source, tensor) if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.tensor = tensor
        self.source = source
        self.detail = message


class UnknownTaskError(HelixError):
    """A request names a task (a fine-tuned variant of the base model) that is not registered."""

    http_status = 404

    def __init__(self, message: str, *, task: str) -> None:
        super().__init__(message)
        self.task = task
