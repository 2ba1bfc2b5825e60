"""`make simulate` runs docker-compose.yml itself, so the compose file cannot drift from what runs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.model


def test_compose_services_run_as_local_processes_over_emulated_links(tmp_path):
    out = tmp_path / "devices.json"
    netns = os.geteuid() == 0 and shutil.which("ip") is not None
    extra = ["--link", "delay_ms=20,jitter_ms=5,rate_mbit=50"] + (["--netns"] if netns else [])
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate.py"), "--timeout", "600", "--json", str(out),
                           *extra], capture_output=True, text=True, timeout=700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "emulated links carried" in done.stdout
    if netns:
        assert "in namespace sled-" in done.stdout and "namespaces removed" in done.stdout
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "sled-" not in left
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    devices = {n for n, s in compose.items() if "workload" in s["command"]}
    summaries = json.loads(out.read_text())
    assert {s["device"] for s in summaries} == {compose[n]["command"][compose[n]["command"].index("--name") + 1]
                                                 for n in devices}
    for s in summaries:
        assert s["requests"] == 3 and s["tokens"] > 0 and s["unverified_tokens"] == 0
    assert "all services stopped" in done.stdout


def test_every_device_service_has_limits_and_a_shipped_config():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, svc in compose.items():
        assert svc["deploy"]["resources"]["limits"]["cpus"] and svc["deploy"]["resources"]["limits"]["memory"]
        args = svc["command"]
        cfg = args[args.index("--config") + 1]
        assert (ROOT / "configs" / Path(cfg).name).is_file(), name
