"""The device agent's HTTP edge: typed requests, OpenAI's error shapes, big prompts off the event loop, apps that
leave mid-stream. The agent runs in this process against a tiny random target."""

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import all_freed

pytestmark = pytest.mark.model
MODEL = "smollm2-sled"


class Daemon:
    """A device agent's HTTP API on its own event loop thread, as `sled-edge serve` runs it."""

    def __init__(self, server_address, **settings):
        from aiohttp import web

        from edge_client.agent import Agent
        from edge_client.config import load_edge_config
        from edge_client.openai_api import OpenAIServer

        config = load_edge_config(None, server=server_address, drafter="ngram", http_port=0, model_name=MODEL,
                                  **settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            self.agent = Agent(config)
            self.runner = web.AppRunner(OpenAIServer(self.agent).app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        self.base = f"http://127.0.0.1:{self.port}"

    def post(self, path, body, timeout=60):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def health(self):
        with urllib.request.urlopen(self.base + "/health", timeout=10) as resp:
            return json.load(resp)

    def stop(self):
        async def stop():
            await self.runner.cleanup()
            await self.agent.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def daemon(make_tiny_server):
    server = make_tiny_server(max_seq_len=256)
    d = Daemon(server.address)
    yield server, d
    d.stop()


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages", "valid string"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": int("9" * 400)}, "max_tokens", "less than or equal"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": "yes"}, "stream_options", "an object"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", "less than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("/v1/completions", {"prompt": [3.5]}, "prompt", ""),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, None, "logprobs not supported"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages", "'system'"),
    ("/v1/completions", b"{not json", None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", None, "JSON object"),
])
def test_bad_requests_get_openai_400s_naming_the_parameter(daemon, path, body, param, needle):
    _, d = daemon
    status, text = d.post(path, body if isinstance(body, bytes) else {"model": MODEL, **body})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"], error["message"]
    assert d.health()["status"] == "ok"


def test_an_unknown_model_is_404_model_not_found(daemon):
    _, d = daemon
    status, text = d.post("/v1/completions", {"model": "gpt-9", "prompt": "hi", "max_tokens": 2})
    error = json.loads(text)["error"]
    assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-9" in error["message"] and MODEL in error["message"]
    status, _ = d.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_greedy_only_rule_refuses_a_sampled_request_with_a_400_and_verifies_a_greedy_one(make_tiny_server, stream):
    """A device that asks for FLy serves greedy requests with it; a sampled request gets a 400 naming the rule,
    before any session opens (it is not verified exactly instead without a word)."""
    server = make_tiny_server(max_seq_len=256)
    d = Daemon(server.address, verification="fly")
    try:
        status, text = d.post("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4,
                                                  "temperature": 0.8, "stream": stream})
        assert status == 400, text
        error = json.loads(text)["error"]
        assert error["param"] == "temperature"
        assert error["message"] == "fly verification applies to greedy generation (temperature 0) only"
        assert server.engine.stats()["sessions_opened"] == 0
        status, text = d.post("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4,
                                                  "temperature": 0, "stream": stream})
        assert status == 200, text
        assert server.engine.stats()["sessions_opened"] >= 1
    finally:
        d.stop()
    assert all_freed(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_servers_context_is_400(daemon, stream):
    server, d = daemon
    prompt = " ".join(["word"] * 400)  # over the server's 256 tokens, within the device's 4096
    status, text = d.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream})
    assert status == 400, text
    assert "context" in json.loads(text)["error"]["message"]
    assert all_freed(server)


def test_a_tiny_positive_temperature_is_greedy(daemon):
    _, d = daemon
    greedy = json.loads(d.post("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 12,
                                                   "temperature": 0})[1])["choices"][0]["text"]
    status, text = d.post("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 12,
                                              "temperature": 1e-40})
    assert status == 200 and greedy
    assert json.loads(text)["choices"][0]["text"] == greedy


def test_a_big_prompt_is_tokenized_off_the_event_loop(daemon):
    _, d = daemon
    entered, release = threading.Event(), threading.Event()
    encode = d.agent.tokenizer.encode

    def held(text):
        entered.set()
        assert release.wait(30)
        return encode(text)

    d.agent.tokenizer.encode = held
    answer = {}
    asking = threading.Thread(target=lambda: answer.update(zip(("status", "text"), d.post(
        "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}))))
    asking.start()
    try:
        assert entered.wait(30)
        assert d.health()["status"] == "ok"  # answered while the tokenizer works
    finally:
        release.set()
        asking.join(60)
    assert answer["status"] == 200, answer


def test_an_app_that_leaves_mid_stream_is_no_error(make_tiny_server, caplog):
    server = make_tiny_server(max_seq_len=256, min_step_ms=30)  # slow steps: the app leaves long before the end
    d = Daemon(server.address)
    caplog.set_level(logging.INFO)
    body = json.dumps({"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 200, "temperature": 0,
                       "stream": True}).encode()
    app = socket.create_connection(("127.0.0.1", d.port))
    app.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    app.settimeout(30)
    seen = b""
    while b"data: " not in seen:  # the stream is under way
        seen += app.recv(4096)
    app.close()
    deadline = time.monotonic() + 30
    while d.health()["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.health()["active_requests"] == 0
    d.stop()
    assert all_freed(server)
    assert server.engine.metrics.emitted_tokens < 200  # it stopped when the app left
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
