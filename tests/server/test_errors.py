"""An error's `type` tells a client whose fault it was: a 4xx never says server_error."""

from __future__ import annotations

import pytest

from server.errors import ApiError


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 409, 413, 429])
def test_client_errors_are_not_typed_as_server_errors(status):
    body = ApiError(status, "nope", param="p", code="c").to_body()
    assert body == {"error": {"message": "nope", "type": body["error"]["type"], "param": "p", "code": "c"}}
    assert body["error"]["type"] not in ("server_error", "service_unavailable")


def test_a_conflict_is_an_invalid_request():
    assert ApiError(409, "Batch b is finalizing").to_body()["error"]["type"] == "invalid_request_error"


def test_unmapped_5xx_is_a_server_error():
    assert ApiError(507, "full").to_body()["error"]["type"] == "server_error"
