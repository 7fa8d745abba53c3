"""Web pages cannot reach a keyless server (issue 29, finding 2): DNS rebinding meets the Host check,
cross-site "simple requests" meet the content-type and Origin checks. Real clients keep working."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest

from server.browser_guard import host_name
from tests.server.fake_engine import FakeEngineFactory
from tests.server.test_api import CHAT, client, error_of, factory, make_config, start  # noqa: F401 - fixtures


REBOUND = {"Host": "attacker.example:8000"}  # what a DNS-rebinding page's requests say


# --------------------------------------------------------------------------- Host
@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None),
    ("GET", "/v1/files", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("DELETE", "/v1/models/fake", None),
])
async def test_a_keyless_server_refuses_unknown_hosts(client, factory, method, path, body):
    response = await client.request(method, path, json=body, headers=REBOUND)
    error = await error_of(response, 400)
    assert error["code"] == "invalid_host" and "--allowed-hosts" in error["message"]
    assert factory.engines["fake"].requests == [] and "fake" in factory.engines  # nothing ran, nothing unloaded


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.9.8.7:1234", "[::1]:8000", "[::1]"])
async def test_loopback_hosts_are_answered(client, host):
    response = await client.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
    assert response.status == 200, await response.text()


async def test_allowed_hosts_and_the_bind_host_are_answered(aiohttp_client, factory, tmp_path):
    config = make_config(tmp_path, host="10.1.2.3", allowed_hosts=("llm.example.com", "[fd00::7]"))
    client = await start(aiohttp_client, factory, config)
    for host in ("llm.example.com", "LLM.example.com:443", "10.1.2.3:8000", "[fd00::7]:8000"):
        response = await client.get("/v1/models", headers={"Host": host})
        assert response.status == 200, (host, await response.text())
    assert (await error_of(await client.get("/v1/models", headers={"Host": "other.example.com"}), 400))[
        "code"] == "invalid_host"


async def test_a_wildcard_bind_host_is_no_host_name_and_star_answers_any(aiohttp_client, tmp_path):
    client = await start(aiohttp_client, FakeEngineFactory(), make_config(tmp_path, host="0.0.0.0"))
    await error_of(await client.get("/v1/models", headers=REBOUND), 400)
    client = await start(aiohttp_client, FakeEngineFactory(), make_config(tmp_path, allowed_hosts=("*",)))
    assert (await client.get("/v1/models", headers=REBOUND)).status == 200


@pytest.mark.parametrize("host", ["10.0.0.9:8000", "192.168.1.20", "[fd00::7]:8000", "203.0.113.5"])
async def test_ip_address_hosts_are_answered(client, host):
    """Rebinding needs a name: a page can send `Host: <address>` only to the machine at that address
    (a LAN client, an orchestrator's probe, a gateway forwarding by pod IP)."""
    response = await client.post("/v1/chat/completions", json=CHAT, headers={"Host": host})
    assert response.status == 200, await response.text()


async def test_keys_from_a_keys_file_turn_the_host_check_off(aiohttp_client, factory, tmp_path):
    config = dataclasses.replace(make_config(tmp_path), named_api_keys=(("alice", "ka"),))
    client = await start(aiohttp_client, factory, config)
    assert (await error_of(await client.get("/v1/models", headers=REBOUND), 401))["code"] == "invalid_api_key"


async def test_probes_answer_any_host(client):
    for path in ("/health", "/ready", "/metrics"):
        assert (await client.get(path, headers={"Host": "10.0.0.9:8000"})).status == 200, path


async def test_with_an_api_key_the_key_decides_not_the_host(aiohttp_client, factory, tmp_path):
    """A page cannot make the browser send our key, so a rebinding page only ever gets 401."""
    client = await start(aiohttp_client, factory, make_config(tmp_path, api_key="k"))
    assert (await error_of(await client.get("/v1/models", headers=REBOUND), 401))["code"] == "invalid_api_key"
    response = await client.get("/v1/models", headers={**REBOUND, "Authorization": "Bearer k"})
    assert response.status == 200


async def test_an_admin_key_alone_keeps_the_host_check(aiohttp_client, factory, tmp_path):
    """With only an admin key, inference and files stay open: a rebinding page could read them."""
    client = await start(aiohttp_client, factory, make_config(tmp_path, admin_api_key="admin"))
    await error_of(await client.get("/v1/models", headers=REBOUND), 400)


def test_host_names_lose_their_port_and_case():
    assert [host_name(h) for h in ("Example.COM:8000", "example.com", "[::1]:80", "[::1]", "::1", "127.0.0.1:1")] \
        == ["example.com", "example.com", "::1", "::1", "::1", "127.0.0.1"]


# --------------------------------------------------------------------------- content type
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/octet-stream"])
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": "fake", "prompt": "hi"}),
    ("/v1/models", {"model_id": "other"}),
    ("/tokenize", {"model": "fake", "prompt": "hi"}),
    ("/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
    ("/v1/inference/completion", {"model_id": "fake", "content": "hi"}),
])
async def test_json_routes_refuse_other_content_types(client, factory, content_type, path, body):
    import json

    response = await client.post(path, data=json.dumps(body), headers={"Content-Type": content_type})
    error = await error_of(response, 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert factory.engines["fake"].requests == [] and list(factory.engines) == ["fake"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
async def test_json_with_any_charset_parameter_is_served(client, content_type):
    import json

    response = await client.post("/v1/chat/completions", data=json.dumps(CHAT), headers={"Content-Type": content_type})
    assert response.status == 200, await response.text()


async def test_a_body_without_a_type_is_json_unless_a_browser_sent_it(client):
    """curl -X POST and httpx's content= send no type; browsers send Origin with every POST."""
    import json

    body = json.dumps(CHAT).encode()
    response = await client.post("/v1/chat/completions", data=body, skip_auto_headers=["Content-Type"])
    assert response.status == 200, await response.text()
    response = await client.post("/v1/chat/completions", data=body, skip_auto_headers=["Content-Type"],
                                 headers={"Origin": "http://localhost:5173"})
    assert (await error_of(response, 415))["code"] == "unsupported_media_type"


async def test_requests_without_a_body_need_no_type(client):
    assert (await client.get("/v1/models")).status == 200
    assert (await client.get("/v1/files")).status == 200
    assert (await client.delete("/v1/models/fake")).status == 200


async def test_uploads_stay_multipart(client):
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b'{"custom_id": "a"}\n', filename="in.jsonl")
    assert (await client.post("/v1/files", data=form)).status == 200


# --------------------------------------------------------------------------- Origin
@pytest.mark.parametrize("origin", ["https://attacker.example", "null"])
async def test_a_keyless_server_refuses_pages_of_other_origins(client, origin):
    form = aiohttp.FormData()  # multipart: a page may send it anywhere without a preflight
    form.add_field("purpose", "batch")
    form.add_field("file", b'{"custom_id": "a"}\n', filename="in.jsonl")
    error = await error_of(await client.post("/v1/files", data=form, headers={"Origin": origin}), 403)
    assert error["code"] == "origin_not_allowed"
    assert (await (await client.get("/v1/files")).json())["data"] == []
    response = await client.post("/v1/batches/batch_x/cancel", headers={"Origin": origin})  # no body, no type
    assert (await error_of(response, 403))["code"] == "origin_not_allowed"


async def test_pages_on_loopback_origins_are_answered(client):
    response = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://localhost:5173"})
    assert response.status == 200, await response.text()


def test_allowed_hosts_from_flags_env_and_yaml(tmp_path):
    from server.__main__ import make_parser
    from server.config import build_config

    def config_from(argv: list[str], env: dict[str, str] | None = None):
        return build_config(make_parser().parse_args(argv), env=env or {})

    assert config_from([]).allowed_hosts == ()
    assert config_from(["--allowed-hosts", "a.example, b.example:8000"]).allowed_hosts == ("a.example", "b.example:8000")
    assert config_from([], {"LLAMASERVE_ALLOWED_HOSTS": "c.example"}).allowed_hosts == ("c.example",)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("server:\n  allowed_hosts: [d.example, '[::1]']\n")
    assert config_from(["--config", str(run_yaml)]).allowed_hosts == ("d.example", "[::1]")
    run_yaml.write_text("server:\n  allowed_hosts: e.example,f.example\n")
    assert config_from(["--config", str(run_yaml)]).allowed_hosts == ("e.example", "f.example")
