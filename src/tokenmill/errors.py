"""Errors that carry enough to answer a user: what was wrong, which field, and the HTTP status."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class for errors that reach users."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(TokenmillError, ValueError):
    """A request field has a bad value; `param` names the field (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(TokenmillError):
    status_code = 404
    error_type = "not_found_error"


class UnsupportedModelError(TokenmillError, ValueError):
    """The checkpoint's architecture or configuration is not supported."""

    status_code = 400
    error_type = "invalid_request_error"


class EngineDeadError(TokenmillError):
    """The engine process died; requests fail fast instead of hanging (HTTP 503)."""

    status_code = 503
    error_type = "service_unavailable"


class LLMClosedError(TokenmillError, RuntimeError):
    """The offline LLM was closed (`LLM.close()`); its engine is gone."""
