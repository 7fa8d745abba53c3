"""Every failure a client can see becomes an ApiError, rendered as OpenAI's error body."""

from __future__ import annotations

import math
from typing import Mapping

import msgspec
import structlog

from engine.types import CheckpointError, ContextLengthExceeded, EngineDead, EngineError, InvalidRequest, QueueFull

_log = structlog.get_logger("llamaserve.errors")

_STATUS_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error with its HTTP status; `to_body()` is the OpenAI `{"error": {...}}` object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _STATUS_TYPES.get(status, "server_error")
        self.headers = dict(headers or {})

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return msgspec.json.encode(self.to_body())


def from_exception(exc: BaseException) -> ApiError:
    """Map any exception to what the client sees; unknown ones become a bare 500 (no traceback,
    no internals: the server log has the details)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), param=exc.param, code=exc.code or "invalid_value")
    if isinstance(exc, QueueFull):
        retry_after_s = max(1, math.ceil(exc.retry_after_s))
        return ApiError(429, str(exc) or "The server is busy; retry later.", code="queue_full",
                        headers={"Retry-After": str(retry_after_s)})
    # The engine's own text (crash reasons, file paths) goes to the log, never to clients.
    if isinstance(exc, EngineDead):
        return ApiError(503, "The model is unavailable; retry shortly.", code="engine_unavailable",
                        headers={"Retry-After": "5"})
    if isinstance(exc, CheckpointError):
        return ApiError(500, "The model failed to load.", code="model_load_failed")
    if isinstance(exc, EngineError):
        return ApiError(500, "The engine failed while processing your request.", code="engine_error")
    return ApiError(500, "The server had an error while processing your request.", code="internal_error")


def from_exception_logged(exc: BaseException, event: str, **fields: object) -> ApiError:
    """from_exception(exc); an unexpected failure (a 5xx that no ApiError announced: a bug, an engine
    or load failure) is logged with its traceback first, since the client sees only a generic message."""
    error = from_exception(exc)
    if error.status >= 500 and not isinstance(exc, ApiError):
        _log.error(event, error=str(exc), exc_info=exc, **fields)
    return error

