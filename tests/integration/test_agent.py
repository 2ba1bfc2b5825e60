"""The device agent daemon, used the way apps use LLM servers: through the official openai client."""

import json
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
from openai import BadRequestError, OpenAI

from tests.conftest import PROMPTS
from tests.integration.test_processes import BIN

pytestmark = pytest.mark.model


def want_text(tokenizer, reference_greedy, prompt_ids, n):
    return tokenizer.decode(reference_greedy(tuple(prompt_ids), n))


def test_completion_plain_and_streamed_equal_target_greedy(agent, tokenizer, reference_greedy):
    server, _, client = agent
    prompt = PROMPTS[6]
    want = want_text(tokenizer, reference_greedy, tokenizer.encode(prompt), 40)
    r = client.completions.create(model="smollm2-sled", prompt=prompt, max_tokens=40, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(reference_greedy(tuple(tokenizer.encode(prompt)), 40))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")
    sled = r.model_extra["sled"]
    assert sled["unverified_tokens"] == 0 and sled["accepted_tokens"] > 0
    chunks = list(client.completions.create(model="smollm2-sled", prompt=prompt, max_tokens=40, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_plain_and_streamed_use_the_chat_template(agent, tokenizer, reference_greedy):
    _, _, client = agent
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.encode(tokenizer.chat_prompt(messages))
    want = want_text(tokenizer, reference_greedy, ids, 48)
    r = client.chat.completions.create(model="smollm2-sled", messages=messages, max_tokens=48, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert "Paris" in want and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="smollm2-sled", messages=messages, max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_models_health_and_stop_strings(agent):
    _, base, client = agent
    assert [m.id for m in client.models.list().data] == ["smollm2-sled"]
    with urllib.request.urlopen(base.removesuffix("/v1") + "/health") as resp:
        health = json.load(resp)
    assert health["status"] == "ok" and health["server_reachable"] is True
    r = client.completions.create(model="smollm2-sled", prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=["9"])
    assert "9" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text.strip().startswith("6")


def test_bad_requests_get_clear_400s(agent):
    _, _, client = agent
    with pytest.raises(BadRequestError, match="'n': Input should be less than or equal to 1"):
        client.completions.create(model="smollm2-sled", prompt="hi", n=2)
    with pytest.raises(BadRequestError, match="temperature"):
        client.completions.create(model="smollm2-sled", prompt="hi", temperature=-1)
    with pytest.raises(BadRequestError, match="messages"):
        client.chat.completions.create(model="smollm2-sled", messages=[])
    with pytest.raises(BadRequestError, match="prompt"):
        client.completions.create(model="smollm2-sled", prompt=[3.5])


def test_concurrent_requests_share_one_channel_each_its_own_session(agent, tokenizer, reference_greedy):
    server, _, client = agent
    prompts = PROMPTS[:4]
    results = {}
    opened_before = server.engine.metrics.sessions_opened

    def call(i):
        results[i] = client.completions.create(model="smollm2-sled", prompt=prompts[i], max_tokens=24, temperature=0)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert results[i].choices[0].text == want_text(tokenizer, reference_greedy, tokenizer.encode(p), 24)
    assert server.engine.metrics.sessions_opened - opened_before == 4
    peers = list(server.server.servicer.recent_peers)[-4:]
    assert len(set(peers)) == 1  # one gRPC connection carries them all


def test_a_daemon_with_an_api_key_serves_only_requests_that_carry_it(make_server, tmp_path, tokenizer,
                                                                     reference_greedy):
    from openai import AuthenticationError

    server = make_server()
    cfg = tmp_path / "device.yaml"
    cfg.write_text(f"server: {server.address}\ncontext_size: 1024\nhttp_port: 0\nhttp_api_key: k-7f3a\n")
    proc = subprocess.Popen([BIN / "sled-edge", "serve", "--config", str(cfg), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.rstrip().endswith(", API key required)"), line
        base = line.split("on ", 1)[1].split(" ", 1)[0]
        with pytest.raises(AuthenticationError) as refused:  # a wrong key
            OpenAI(base_url=base, api_key="unused", max_retries=0).completions.create(model="sled", prompt="hi")
        assert refused.value.status_code == 401
        with pytest.raises(urllib.error.HTTPError) as refused:  # none at all
            urllib.request.urlopen(base + "/models")
        assert refused.value.code == 401 and json.load(refused.value)["error"]["message"].startswith(
            "an API key is required")
        assert server.engine.metrics.sessions_opened == 0
        with urllib.request.urlopen(base.removesuffix("/v1") + "/health") as resp:  # liveness probes need no key
            assert json.load(resp)["status"] == "ok"
        prompt = PROMPTS[6]
        r = OpenAI(base_url=base, api_key="k-7f3a").completions.create(model="sled", prompt=prompt, max_tokens=16,
                                                                       temperature=0)
        assert r.choices[0].text == want_text(tokenizer, reference_greedy, tokenizer.encode(prompt), 16)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_a_request_whose_app_went_away_stops_generating(agent):
    import socket
    import time

    from tests.conftest import all_freed

    server, base, _ = agent
    host, port = base.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    body = json.dumps({"model": "smollm2-sled", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 800, "temperature": 0}).encode()
    app = socket.create_connection((host, int(port)))
    app.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while server.engine.metrics.emitted_tokens == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.metrics.emitted_tokens > 0  # generating: now the app gives up and closes
    app.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base.removesuffix("/v1") + "/health") as resp:
            if json.load(resp)["active_requests"] == 0:
                break
        time.sleep(0.1)
    assert all_freed(server)  # the server's session closed with it
    # it stopped at the round after the app left (a few rounds here), not at the text's end (499 tokens, EOS)
    emitted = server.engine.metrics.emitted_tokens
    assert emitted < 250, emitted


def test_a_request_past_max_queued_is_answered_503_at_once(make_server, tmp_path):
    import socket
    import time

    server = make_server()
    cfg = tmp_path / "device.yaml"
    cfg.write_text(f"server: {server.address}\ndrafter: ngram\ncontext_size: 1024\nhttp_port: 0\n"
                   "max_concurrent: 1\nmax_queued: 1\n")
    proc = subprocess.Popen([BIN / "sled-edge", "serve", "--config", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = proc.stdout.readline().split("on ", 1)[1].split(" ", 1)[0]
    host, port = base.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)

    def health():
        with urllib.request.urlopen(base.removesuffix("/v1") + "/health") as resp:
            return json.load(resp)

    def ask(max_tokens, stream=False):  # a raw connection: the test closes it to end the request
        body = json.dumps({"model": "sled", "prompt": "1, 2, 3, 4, 5,", "max_tokens": max_tokens, "temperature": 0,
                           "stream": stream}).encode()
        app = socket.create_connection((host, int(port)))
        app.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        return app

    def until(check):
        deadline = time.monotonic() + 30
        while not check() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert check()

    try:
        generating = ask(400)
        until(lambda: health()["active_requests"] == 1)
        waiting = ask(400)
        until(lambda: health()["waiting_requests"] == 1)
        for stream in (False, True):
            app = ask(8, stream)
            app.settimeout(10)
            answer = app.recv(65536).decode()
            app.close()
            assert answer.startswith("HTTP/1.1 503") and "Retry-After: 1" in answer, answer
            assert ("the device agent is busy: 1 requests generating (max_concurrent 1) and 1 waiting (max_queued 1); "
                    "retry later") in answer
        generating.close()
        waiting.close()
        until(lambda: health()["active_requests"] == 0 and health()["waiting_requests"] == 0)
        assert health()["served_requests"] == 2  # the refused ones never took a slot
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
