"""Every failure a client can see becomes an ApiError, rendered as OpenAI's error body."""

from __future__ import annotations

from typing import Mapping

import msgspec

_STATUS_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
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
