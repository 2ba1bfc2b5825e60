"""The device agent's local API key: the /v1 routes refuse a request without the key with OpenAI's 401, /health stays
open, and a daemon listening beyond this machine without a key is warned about."""

import asyncio
import dataclasses

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from edge_client.config import EdgeConfig, load_edge_config
from edge_client.openai_api import api_key_check, exposure_warning


async def answers(key, requests):
    async def ok(request):
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[api_key_check(key)])
    app.add_routes([web.get("/v1/models", ok), web.get("/health", ok)])
    async with TestClient(TestServer(app)) as client:
        out = []
        for path, headers in requests:
            resp = await client.get(path, headers=headers)
            out.append((resp.status, await resp.json(), resp.headers.get("WWW-Authenticate")))
        return out


def test_a_key_guards_the_v1_routes_and_leaves_health_open():
    got = asyncio.run(answers("s3cret", [
        ("/v1/models", {"Authorization": "Bearer s3cret"}),
        ("/v1/models", {}),
        ("/v1/models", {"Authorization": "Bearer wrong"}),
        ("/v1/models", {"Authorization": "Basic s3cret"}),  # the key, but not as a bearer token
        ("/health", {}),
    ]))
    assert got[0][:2] == (200, {"ok": True})
    for status, body, challenge in got[1:4]:
        assert (status, challenge) == (401, "Bearer") and body["error"]["type"] == "invalid_request_error"
    assert got[1][1]["error"]["message"].startswith("an API key is required: send it as 'Authorization: Bearer <key>'")
    assert got[2][1]["error"]["message"] == "the API key given is not this device agent's"
    assert got[3][1]["error"]["message"].startswith("an API key is required")
    assert got[4][:2] == (200, {"ok": True})


def test_without_a_key_every_request_is_served():
    got = asyncio.run(answers(None, [("/v1/models", {}), ("/v1/models", {"Authorization": "Bearer anything"})]))
    assert [g[0] for g in got] == [200, 200]


def test_the_key_setting_is_checked():
    assert load_edge_config(http_api_key="k").http_api_key == "k"
    for value, says in (("", "http_api_key must not be empty"), ("  ", "http_api_key must not be empty"),
                        (12345, "http_api_key must be a string")):
        with pytest.raises(ValueError, match=says):
            load_edge_config(http_api_key=value)


def test_a_daemon_open_beyond_this_machine_without_a_key_is_warned_about():
    base = EdgeConfig()
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(dataclasses.replace(base, http_host=host)) is None
    for host in ("0.0.0.0", "192.168.1.20", "pi5.local"):
        warning = exposure_warning(dataclasses.replace(base, http_host=host))
        assert warning == (f"the local API on {host} takes requests from anyone who can reach it: set http_api_key "
                           "(or --api-key) to ask for a key")
        assert exposure_warning(dataclasses.replace(base, http_host=host, http_api_key="k")) is None
