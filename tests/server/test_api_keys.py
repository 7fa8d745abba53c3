"""Several API keys from a keys file (--api-keys-file), and the owner name auth gives each request
(issue 29, finding 3): the Batch API keeps each owner's files and batches apart."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from server import auth
from server.__main__ import make_parser
from server.config import ConfigError, build_config
from server.errors import ApiError


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return path


def test_a_keys_file_names_its_keys(tmp_path):
    path = keys_file(tmp_path, "# name key\nalice  sk-alice-1\n\nbob\tsk-bob\nalice sk-alice-2  # rotated\n")
    config = build_config(make_parser().parse_args(["--api-keys-file", str(path)]), {})
    assert config.named_api_keys == (("alice", "sk-alice-1"), ("bob", "sk-bob"), ("alice", "sk-alice-2"))
    from_env = build_config(make_parser().parse_args([]), {"LLAMASERVE_API_KEYS_FILE": str(path)})
    assert from_env.named_api_keys == config.named_api_keys


@pytest.mark.parametrize("text,words", [
    ("alice\n", "line 1: expected 'NAME KEY'"),
    ("alice sk-1 extra\n", "line 1: expected 'NAME KEY'"),
    ("al/ice sk-1\n", "line 1: the name"),
    ("alice sk-1\nbob sk-1\n", "line 2: the same key as line 1"),
    ("alice sk-main\n", "line 1: the same key as --api-key"),
    ("# only comments\n\n", "no keys"),
])
def test_a_bad_keys_file_is_a_clear_error_that_never_shows_a_key(tmp_path, text, words):
    path = keys_file(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        build_config(make_parser().parse_args(["--api-keys-file", str(path), "--api-key", "sk-main"]), {})
    assert words in str(raised.value) and str(path) in str(raised.value)
    assert "sk-1" not in str(raised.value) and "sk-main" not in str(raised.value)


def test_a_missing_keys_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError) as raised:
        build_config(make_parser().parse_args(["--api-keys-file", str(tmp_path / "nope")]), {})
    assert "cannot read" in str(raised.value)


def request(path: str = "/v1/files", token: str | None = None, method: str = "GET"):
    from aiohttp.test_utils import make_mocked_request

    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: ("10.0.0.9", 5555) if name == "peername" else default
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return make_mocked_request(method, path, headers=headers, transport=transport)


NAMED = (("alice", "sk-alice"), ("bob", "sk-bob"))


def test_auth_names_the_owner_of_each_request():
    assert auth.check(request(), None, None) == auth.DEFAULT_OWNER  # no keys: everyone is one owner
    assert auth.check(request(token="sk-main"), "sk-main", None) == auth.DEFAULT_OWNER
    assert auth.check(request(token="sk-admin"), "sk-main", "sk-admin") == auth.ADMIN_OWNER
    assert auth.check(request(token="sk-bob"), "sk-main", None, named_keys=NAMED) == "bob"
    assert auth.check(request(token="sk-alice"), None, None, named_keys=NAMED) == "alice"
    assert auth.check(request(), None, "sk-admin") == auth.DEFAULT_OWNER  # only an admin key: inference is open
    for token in (None, "sk-nope"):  # keys from a file are required like --api-key
        with pytest.raises(ApiError) as raised:
            auth.check(request(token=token), None, None, named_keys=NAMED)
        assert raised.value.status == 401


def test_named_keys_guard_registry_routes_as_the_api_key_does_unless_an_admin_key_is_set():
    registry = request("/v1/models", token="sk-bob", method="POST")
    assert auth.check(registry, None, None, named_keys=NAMED) == "bob"
    with pytest.raises(ApiError) as raised:
        auth.check(registry, None, "sk-admin", named_keys=NAMED)
    assert raised.value.status == 403 and raised.value.code == "admin_key_required"
    # A key named "admin" in the file owns what "admin" owns, but it is not the admin key.
    with pytest.raises(ApiError):
        auth.check(request("/v1/models", token="sk-x", method="POST"), None, "sk-admin", named_keys=(("admin", "sk-x"),))


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_vllm_lora_routes_are_behind_the_admin_gate(path):
    with pytest.raises(ApiError) as raised:
        auth.check(request(path, token="sk-main", method="POST"), "sk-main", "sk-admin")
    assert raised.value.status == 403 and raised.value.code == "admin_key_required"
    assert auth.check(request(path, token="sk-admin", method="POST"), "sk-main", "sk-admin") == auth.ADMIN_OWNER
    with pytest.raises(ApiError) as raised:  # no key at all: loopback clients only, as for /v1/models
        auth.check(request(path, method="POST"), None, None)
    assert raised.value.code == "admin_requires_loopback"
