"""Real processes: a sled-server and sled-edge devices talking over loopback."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.processes import free_port
from tests.conftest import PROMPTS

pytestmark = pytest.mark.model
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([BIN / "sled-server", "--port", str(port), "--max-sessions", "8",
                                 "--max-seq-len", "512"], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while "ready on" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, "server did not become ready"
        time.sleep(0.5)
    yield proc, f"127.0.0.1:{port}", log
    if proc.poll() is None:
        proc.kill()


def edge(args, timeout=180):
    return subprocess.run([BIN / "sled-edge", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("drafter", ["llama-cpp", "ngram", "none"])
def test_sled_edge_generate_streams_text_and_writes_stats(server_process, tmp_path, tokenizer, reference_greedy,
                                                          drafter):
    _, address, _ = server_process
    stats_file = tmp_path / "stats.json"
    done = edge(["generate", PROMPTS[4], "--server", address, "--drafter", drafter, "--max-tokens", "32",
                 "--stats-json", str(stats_file)])
    assert done.returncode == 0, done.stderr
    stats = json.loads(stats_file.read_text())
    for key in ("prompt_token_ids", "token_ids", "text", "rounds", "draft_tokens", "accepted_tokens",
                "acceptance_rate", "mean_acceptance_length", "tokens_per_second"):
        assert key in stats
    assert stats["prompt_token_ids"] == tokenizer.encode(PROMPTS[4])
    assert stats["token_ids"] == reference_greedy(tuple(stats["prompt_token_ids"]), 32)
    assert stats["text"].strip() and stats["text"].strip() in done.stdout
    assert stats["tokens_per_second"] > 0
    if drafter == "llama-cpp":
        assert stats["accepted_tokens"] > 0 and stats["mean_acceptance_length"] > 1
    if drafter == "none":
        assert stats["draft_tokens"] == 0 and stats["rounds"] == len(stats["token_ids"])


def test_edge_reports_a_refusal_clearly(server_process, tmp_path):
    _, address, _ = server_process
    other = tmp_path / "other_vocab.gguf"
    done = edge(["generate", "hi", "--server", address, "--draft-tokens", "99", "--drafter", "none",
                 "--temperature", "-1"])
    assert done.returncode == 2 and "temperature" in done.stderr
    done = edge(["generate", "hi", "--server", address, "--draft-model", str(other)])
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_sled_edge_info_reports_the_servers_kernels_and_counts_a_generation(server_process):
    _, address, log = server_process
    before = edge(["info", "--server", address, "--json"], timeout=60)
    assert before.returncode == 0, before.stderr
    before = json.loads(before.stdout)
    done = edge(["generate", PROMPTS[1], "--server", address, "--drafter", "none", "--max-tokens", "12", "--quiet"])
    assert done.returncode == 0, done.stderr
    after = json.loads(edge(["info", "--server", address, "--json"], timeout=60).stdout)
    assert after["target_name"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and after["vocab_size"] == 49152
    assert after["max_sessions"] == 8 and after["context_limit"] == 512
    # the threshold its start-up calibration chose, as its log says it
    fused = re.search(r"warm in .*fused up to (\d+) tokens", log.read_text())
    assert fused and after["fused_max_tokens"] == int(fused.group(1)) > 0
    assert (after["device"], after["dtype"], after["attention"]) == ("cpu", "float32", "sdpa")
    grew = {k: after["stats"][k] - before["stats"][k] for k in ("sessions_opened", "emitted_tokens", "draft_tokens")}
    assert grew == {"sessions_opened": 1, "emitted_tokens": 12, "draft_tokens": 0}
    assert after["stats"]["steps"] >= before["stats"]["steps"] + 12
    text = edge(["info", "--server", address], timeout=60)
    assert text.returncode == 0, text.stderr
    assert "target: SmolLM2-135M-Instruct.Q4_1.gguf" in text.stdout
    assert f"kernels: cpu float32, sdpa attention, {after['linear']} linear; the fused CPU step for steps of up to " \
           f"{after['fused_max_tokens']} tokens" in text.stdout


def test_sled_edge_info_says_when_no_server_answers():
    done = edge(["info", "--server", f"127.0.0.1:{free_port()}", "--timeout", "1"], timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert "no answer from 127.0.0.1:" in done.stderr and "within 1s" in done.stderr
    assert "the last connection attempt: UNAVAILABLE" in done.stderr and "Connection refused" in done.stderr
    done = edge(["info", "--timeout", "0"], timeout=60)
    assert done.returncode == 2 and "--timeout must be > 0" in done.stderr


def test_help_documents_every_option():
    server = subprocess.run([BIN / "sled-server", "--help"], capture_output=True, text=True)
    for flag in ("--host", "--port", "--target", "--config", "--max-batch-sessions", "--max-batch-tokens",
                 "--max-wait-ms", "--max-sessions", "--idle-timeout-s"):
        assert flag in server.stdout
    gen = edge(["generate", "--help"])
    for flag in ("--server", "--drafter", "--draft-model", "--draft-tokens", "--max-tokens", "--temperature",
                 "--top-k", "--top-p", "--seed", "--stats-json"):
        assert flag in gen.stdout
    info = edge(["info", "--help"])
    for flag in ("--server", "--timeout", "--json"):
        assert flag in info.stdout


def test_every_script_with_a_main_answers_help_without_starting_anything():
    """`--help` on each script prints its usage and returns at once (demo.py used to start a server on it)."""
    root = Path(__file__).resolve().parents[2]
    scripts = [p for p in sorted((root / "scripts").glob("*.py")) if "__main__" in p.read_text()]
    assert any(p.name == "demo.py" for p in scripts)
    for script in scripts:
        done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60,
                              cwd=root)
        assert done.returncode == 0 and done.stdout.startswith("usage:"), (script.name, done.stdout[:200],
                                                                           done.stderr[-500:])


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("max_sessions: -3\n")
    done = subprocess.run([BIN / "sled-server", "--config", str(cfg)], capture_output=True, text=True)
    assert done.returncode == 2 and "max_sessions must be positive" in done.stderr
    cfg.write_text("max_sesions: 3\n")
    done = subprocess.run([BIN / "sled-server", "--config", str(cfg)], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown server settings ['max_sesions']" in done.stderr


def test_server_stops_gracefully_on_sigterm(server_process):
    proc, _, log = server_process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "shutting down" in log.read_text()


@pytest.mark.parametrize("setting, message", [
    (["--target", "/nowhere/target.gguf"], "target model /nowhere/target.gguf does not exist"),
    (["--device", "cuda:99"], "device 'cuda:99' asked for, but"),
    (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1:"),
    (["--max-seq-len", "100000"], "max_seq_len 100000 is past the target's context length 8192"),
])
def test_a_server_that_cannot_start_says_why_and_exits_cleanly(setting, message):
    # The port is open (NOT_SERVING) while the target loads: a failed load closes it before the loop ends, where
    # it once left grpc's own 'Event loop is closed' traceback after the message. An address it cannot bind was a
    # RuntimeError's traceback.
    done = subprocess.run([BIN / "sled-server", "--port", str(free_port()), *setting], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"sled-server: {message}" in done.stderr
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr


def test_a_metrics_port_in_use_is_named_in_the_error():
    import socket

    port, metrics = free_port(), socket.socket()
    with metrics:
        metrics.bind(("127.0.0.1", 0))
        metrics.listen()
        taken = metrics.getsockname()[1]
        done = subprocess.run([BIN / "sled-server", "--port", str(port), "--metrics-port", str(taken), "--fused", "off"],
                              capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    assert f"sled-server: cannot serve metrics on 127.0.0.1:{taken}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
