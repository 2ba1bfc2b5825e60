"""The device agent daemon as apps meet it: a sled-edge serve process before a real server."""

import subprocess

import pytest
from openai import OpenAI

from tests.integration.test_processes import BIN


@pytest.fixture
def agent(make_server, tmp_path):
    server = make_server()
    cfg = tmp_path / "device.yaml"
    cfg.write_text(f"server: {server.address}\ndrafter: llama-cpp\ndraft_tokens: 4\ncontext_size: 1024\n"
                   "max_concurrent: 4\nhttp_port: 0\nmodel_name: smollm2-sled\n")
    proc = subprocess.Popen([BIN / "sled-edge", "serve", "--config", str(cfg), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert "SLED device agent on http://" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
    base = line.split("on ", 1)[1].split(" ", 1)[0]
    yield server, base, OpenAI(base_url=base, api_key="unused")
    proc.terminate()
    assert proc.wait(timeout=30) == 0
