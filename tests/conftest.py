"""Shared fixtures: one loaded target model per test session, in-process servers around it, references."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "import numpy as np\n\n",
    "List three fruits: apple,",
    "The quick brown fox",
    "In machine learning, overfitting means",
    "1, 2, 3, 4, 5,",
    "The best way to learn a language is",
    "Photosynthesis is the process by which",
    "Dear customer, thank you for",
    "SELECT name FROM users WHERE",
    "The sun rises in the",
    "Here is a recipe for pancakes:",
    "A haiku about autumn:\n",
    "The largest planet in the solar system is",
    "To be or not to be,",
    "Monday, Tuesday, Wednesday,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The history of the Roman Empire",
]


def run(coro):
    return asyncio.run(coro)


class ServerThread:
    """A VerifyServer on its own event loop thread, as the sled-server process runs it."""

    def __init__(self, config, target):
        from verify_server.server import VerifyServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make():
            server = VerifyServer(config, target=target)
            await server.start()
            return server

        self.server = self.call(make())
        self.address = f"127.0.0.1:{self.server.port}"
        self._stop_lock = threading.Lock()
        self._stopped = False

    def call(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def load(self):
        self.call(self.server.load())
        return self

    @property
    def engine(self):
        return self.server.engine

    def stop(self):
        with self._stop_lock:  # a test may stop its server from another thread while teardown stops it too
            if self._stopped:
                return
            self._stopped = True
            self._stop()

    def _stop(self):
        self.call(self.server.stop(grace=1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def start_cache(tmp_path_factory):
    """The session's start cache: the default GGUF target is converted into it once, by `target`."""
    from verify_server.start_cache import StartCache

    return StartCache(tmp_path_factory.mktemp("start-cache"))


@pytest.fixture(scope="session")
def target(start_cache):
    import torch

    from verify_server.model_loader import load_target

    return load_target(None, torch.device("cpu"), torch.float32, cache=start_cache)


def all_freed(server, within_s=5.0) -> bool:
    """Whether the server's sessions are all freed within `within_s` (its engine closes them from its inbox)."""
    deadline = time.monotonic() + within_s
    while server.engine.stats()["active_sessions"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.engine.stats()["active_sessions"] == 0


@pytest.fixture(scope="session")
def tiny():
    """A random-weight Llama of a tiny shape in the devices' vocabulary (random:llama-tiny): quick steps."""
    import torch

    from verify_server.model_loader import load_target

    return load_target("random:llama-tiny", torch.device("cpu"), torch.float32)


@pytest.fixture
def tiny_server(tiny):
    from verify_server.config import ServerConfig

    server = ServerThread(ServerConfig(host="127.0.0.1", port=0, max_sessions=8, max_seq_len=256, seed=0,
                                       target="random:llama-tiny"), tiny).load()
    yield server
    server.stop()


@pytest.fixture
def make_tiny_server(tiny):
    """Start servers of the tiny random target with any settings; stopped after the test."""
    started = []

    def make(**settings):
        from verify_server.config import ServerConfig

        base = dict(host="127.0.0.1", port=0, max_sessions=8, max_seq_len=256, seed=0, target="random:llama-tiny")
        base.update(settings)
        server = ServerThread(ServerConfig(**base), tiny).load()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def tokenizer():
    from edge_client.tokenizer import Tokenizer

    return Tokenizer()


@pytest.fixture
def make_server(target):
    """Start servers sharing the session's target; each gets its own engine, KV pool and port."""
    started = []

    def make(load=True, **settings):
        from verify_server.config import ServerConfig

        # fused_max_tokens set: no calibration at each start (about 15 s here; it has its own tests), and every
        # host runs the same paths: the fused step up to 64 tokens, PyTorch past them.
        base = dict(host="127.0.0.1", port=0, max_sessions=24, max_seq_len=512, max_wait_ms=5.0, seed=0,
                    fused_max_tokens=64)
        base.update(settings)
        server = ServerThread(ServerConfig(**base), target)
        started.append(server)
        return server.load() if load else server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def reference_greedy(target):
    """Target-only greedy decoding with transformers' own generate(): the ground truth for temperature 0."""
    import torch

    @functools.lru_cache(maxsize=None)
    def decode(prompt_ids: tuple[int, ...], max_tokens: int) -> list[int]:
        eos = list(target.eos_token_ids)
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                        eos_token_id=eos, pad_token_id=eos[0])
        ids = out[0, len(prompt_ids):].tolist()
        for i, tok in enumerate(ids):
            if tok in eos:
                return ids[: i + 1]
        return ids

    return decode


def user_tool(script: str, *args: str):
    """Run a user tool of scripts/ by its command line, as a user does."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / script
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="session")
def onnx_drafts(tmp_path_factory):
    """Drafts exported from the default target: 2 layers fp32, and 6 layers int8 (a weaker, self-speculative draft)."""
    out = tmp_path_factory.mktemp("onnx")
    made = {}
    for name, args in (("fp32", ["--layers", "2"]), ("int8", ["--layers", "6", "--int8"])):
        path = out / f"{name}.onnx"
        done = user_tool("export_onnx_draft.py", "--output", str(path), *args)
        assert done.returncode == 0, done.stderr
        made[name] = path
    return made


@pytest.fixture(scope="session")
def requantized_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "smollm2-q2k.gguf"
    done = user_tool("requantize_gguf.py", "--output", str(path), "--type", "q2_k")
    assert done.returncode == 0, done.stderr
    return path
