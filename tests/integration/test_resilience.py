"""Nothing lost: the device reconnects and reopens with its full history; fallback policies when it cannot."""

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.generation import _Generation, generate
from edge_client.request import Callbacks, Request
from edge_client.resilience import Resilience
from edge_client.policy import DraftPolicy
from edge_client.transport import VerifierClient, VerifyError
from tests.conftest import PROMPTS, run
from sim.processes import free_port
from tests.integration.test_processes import BIN

pytestmark = pytest.mark.model
LONG = PROMPTS[21]  # "The history of the Roman Empire": runs long without EOS


def start_server(port, log):
    out = open(log, "a")
    proc = subprocess.Popen([BIN / "sled-server", "--port", str(port), "--max-sessions", "4", "--max-seq-len", "512"],
                            stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while log.read_text().count("ready on") < start_server.count.get(port, 0) + 1:
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.3)
    start_server.count[port] = start_server.count.get(port, 0) + 1
    return proc


start_server.count = {}


def test_server_killed_mid_generation_then_restarted_gives_the_uninterrupted_text(tmp_path, tokenizer,
                                                                                   reference_greedy):
    port = free_port()
    log = tmp_path / "server.log"
    first = start_server(port, log)
    second = None
    stats_file = tmp_path / "stats.json"
    edge = subprocess.Popen([BIN / "sled-edge", "generate", LONG, "--server", f"127.0.0.1:{port}", "--drafter", "none",
                             "--max-tokens", "100", "--stats-json", str(stats_file), "--wait-deadline", "180"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        os.set_blocking(edge.stdout.fileno(), False)
        seen = b""
        deadline = time.time() + 60
        while len(seen) < 40:  # some text is out: the generation is under way
            assert time.time() < deadline and edge.poll() is None
            seen += edge.stdout.read() or b""
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_server(port, log)
        os.set_blocking(edge.stdout.fileno(), True)
        out, err = edge.communicate(timeout=240)
    finally:
        for proc in (first, second, edge):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert edge.returncode == 0, err
    stats = json.loads(stats_file.read_text())
    assert stats["reconnects"] >= 1 and stats["unverified_tokens"] == 0
    assert stats["token_ids"] == reference_greedy(tuple(tokenizer.encode(LONG)), 100)
    assert stats["text"] in (seen + out).decode()


def _generate_with_outage(make_server, tokenizer, resilience, restart=False, max_tokens=60, statuses=None):
    """Generate on an in-process server that stops after the first 10 tokens (and maybe comes back); the
    generation's status messages go to `statuses`."""
    server = make_server()
    port = server.server.port
    prompt = tokenizer.encode(LONG)
    drafter = create_drafter("llama-cpp", DrafterOptions(context_size=512, threads=1))
    state = {"stopped": False}
    replacement = {}

    def on_text(piece, verified):
        if not state["stopped"] and len(result_tokens()) >= 10:
            state["stopped"] = True
            # Stopped here, before the next draft goes out: stopped from another thread, a fast server
            # finished the whole generation within its graceful-stop window and there was no outage.
            server.stop()
            if restart:
                threading.Thread(target=come_back).start()

    def come_back():
        time.sleep(1.0)
        replacement["server"] = make_server(port=port)

    holder = {}

    def result_tokens():
        return holder.get("gen").result.token_ids if "gen" in holder else []

    async def go():
        client = VerifierClient(server.address)
        policy = DraftPolicy(draft_tokens=3, adaptive=False)
        heard = Callbacks(on_text=on_text, on_status=None if statuses is None else statuses.append)
        gen = _Generation(client, drafter, tokenizer, Request(prompt, max_tokens, policy=policy, client_id="test"),
                          resilience, policy.controller(None), heard)
        holder["gen"] = gen
        try:
            return await gen.run()
        finally:
            await client.close()

    try:
        return prompt, run(go())
    finally:
        drafter.close()


def test_wait_policy_reconnects_to_a_restarted_server(make_server, tokenizer, reference_greedy):
    statuses = []
    prompt, result = _generate_with_outage(make_server, tokenizer, Resilience(wait_deadline_s=60), restart=True,
                                           statuses=statuses)
    assert result.reconnects >= 1 and result.unverified_tokens == 0
    assert result.token_ids == reference_greedy(tuple(prompt), 60)
    assert "unreachable" in statuses[0] and "waiting up to 60s" in statuses[0]
    assert "reopened the session after" in statuses[-1] and "with its whole context" in statuses[-1]


def test_wait_policy_waits_for_a_server_not_yet_up_and_says_so(make_server, tokenizer, reference_greedy):
    port, statuses = free_port(), []
    prompt = tokenizer.encode(LONG)
    drafter = create_drafter("llama-cpp", DrafterOptions(context_size=512, threads=1))
    starting = threading.Timer(1.5, lambda: make_server(port=port))
    starting.start()

    async def go():
        client = VerifierClient(f"127.0.0.1:{port}")
        try:
            return await generate(
                client,
                drafter,
                tokenizer,
                Request(prompt, max_tokens=20, policy=DraftPolicy(draft_tokens=3)),
                resilience=Resilience(wait_deadline_s=120),
                callbacks=Callbacks(on_status=statuses.append),
            )
        finally:
            await client.close()

    try:
        result = run(go())
    finally:
        starting.join()
        drafter.close()
    assert result.token_ids == reference_greedy(tuple(prompt), 20) and result.unverified_tokens == 0
    assert result.reconnects == 0
    assert len(statuses) == 2
    assert "unreachable" in statuses[0] and "waiting up to 120s" in statuses[0]
    assert "opened the session after" in statuses[1] and "reopened" not in statuses[1]


def test_wait_policy_gives_up_at_its_deadline(make_server, tokenizer):
    with pytest.raises(VerifyError) as err:
        _generate_with_outage(make_server, tokenizer, Resilience(wait_deadline_s=2, backoff_initial_s=0.1,
                                                                 round_timeout_s=1))
    assert err.value.code == "DEADLINE_EXCEEDED" and "wait deadline" in err.value.message


def test_fail_policy_fails_at_once_with_a_clear_error(make_server, tokenizer):
    with pytest.raises(VerifyError) as err:
        _generate_with_outage(make_server, tokenizer, Resilience(fallback="fail"))
    assert "fallback policy is fail" in err.value.message


def test_local_policy_continues_with_the_drafter_and_marks_tokens_unverified(make_server, tokenizer,
                                                                             reference_greedy):
    prompt, result = _generate_with_outage(make_server, tokenizer, Resilience(fallback="local", backoff_initial_s=0.5))
    assert len(result.token_ids) == 60 and result.finish_reason == "length"
    first_local = result.token_verified.index(False)
    assert first_local >= 10 and all(not ok for ok in result.token_verified[first_local:])
    assert result.unverified_tokens == 60 - first_local
    want = reference_greedy(tuple(prompt), 60)
    assert result.token_ids[:first_local] == want[:first_local]
    assert result.stats()["unverified_token_indices"] == list(range(first_local, 60))
