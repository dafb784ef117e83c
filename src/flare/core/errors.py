"""Typed errors shared by preparation, runtime and server.

Every error carries an HTTP status, an OpenAI-style ``type`` and a stable
machine-readable ``code``; the field that was wrong goes in ``param``. Code
dispatches on the class or on ``code``, never on message text.
"""

from __future__ import annotations


class FlareError(Exception):
    """Base class. Subclasses fix the status and type; callers pick the code."""

    status: int = 500
    type: str = "server_error"
    default_code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code

    def envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ManifestError(FlareError):
    """A runtime core that cannot be loaded: missing/unknown fields, bad layout, ABI mismatch."""

    default_code = "invalid_core"


class CoreCompatibilityError(ManifestError):
    """The core is valid but was prepared for something this process cannot provide
    (another compute capability, another ABI, an address range that is taken)."""

    default_code = "incompatible_core"


class FrontendError(FlareError):
    """A request that is malformed or asks for something out of contract."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class UnprocessableError(FrontendError):
    """Well-formed JSON whose values cannot be processed (schema violations)."""

    status = 422


class PayloadTooLargeError(FrontendError):
    status = 413
    default_code = "payload_too_large"


class NotFoundError(FrontendError):
    status = 404
    default_code = "not_found"


class AuthenticationError(FrontendError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class AdmissionError(FrontendError):
    """A request that can never be admitted by this core (prompt over the context limit,
    a reservation larger than the whole page pool)."""

    default_code = "context_length_exceeded"


class GrammarError(FrontendError):
    """A structured-output request whose grammar cannot be compiled within the limits
    (invalid schema or regex, too complex, compile timeout)."""

    default_code = "invalid_grammar"


class ModelOutputError(FlareError):
    """Generation finished but its output breaks the request's contract: a malformed or
    unknown tool call, a required tool call that was not made, a grammar that failed
    while decoding. The request was valid and the server healthy."""

    status = 422
    type = "model_output_error"
    default_code = "invalid_model_output"


class CapacityError(FlareError):
    """Capacity that is temporarily unavailable: the admission queue is full, the
    server is shutting down or the worker is not ready."""

    status = 503
    type = "server_error"
    default_code = "capacity_unavailable"


class ExecutionError(FlareError):
    """A program failed on the executor. The worker is considered broken afterwards."""

    status = 500
    type = "server_error"
    default_code = "execution_failed"
