"""`make simulate` runs docker-compose.yml itself, so the compose file cannot drift from what runs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.model


def test_compose_services_run_as_local_processes_over_emulated_links(tmp_path):
    out = tmp_path / "devices.json"
    netns = os.geteuid() == 0 and shutil.which("ip") is not None
    # the fleet profile: two servers, and devices that take both
    extra = ["--link", "delay_ms=20,jitter_ms=5,rate_mbit=50", "--profile", "fleet"] + (["--netns"] if netns else [])
    done = subprocess.run([sys.executable, "-m", "sim.compose", "--timeout", "600", "--json", str(out),
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


LINGERING_SERVER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def on_term(*_):
    out.with_suffix('.term').write_text('')
    time.sleep(3)  # a server finishing its sessions: the run's clean-up waits for it
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
out.write_text('started')
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_second_signal_during_the_clean_up_does_not_cut_it_short(tmp_path, sig):
    """Interrupted twice (an impatient Ctrl-C, or a supervisor's repeated SIGTERM) while it waits for a service to
    stop, the run still stops every service and finishes its clean-up (links, namespaces) instead of dying in it."""
    marker = tmp_path / "server"
    compose = tmp_path / "compose.yml"
    compose.write_text(yaml.safe_dump({"services": {"slow-server": {
        "command": ["python", "-c", LINGERING_SERVER, str(marker), "--port", "50051"]}}}))
    # faulthandler: a run stuck where it should not be dumps every thread's stack on SIGABRT (below)
    run = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "sim.compose", "--compose",
                            str(compose), "--timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():  # the service runs and is never healthy: the run waits for it
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        run.send_signal(sig)
        while not marker.with_suffix(".term").exists():  # the clean-up has asked the service to stop
            if run.poll() is not None or time.monotonic() > deadline:
                # Failed in two full runs (stops 45 and 61): say whether the run died or hangs, and where. The
                # second's stacks showed why: the signal came inside a gRPC channel's __del__, which dropped the
                # handler's exception (now the handler only records it: simulate.interrupted).
                state = f"exited with {run.returncode}" if run.poll() is not None else "still running (stacks below)"
                if run.poll() is None:
                    run.send_signal(signal.SIGABRT)
                out, err = run.communicate(timeout=30)
                pytest.fail(f"the clean-up never asked the service to stop; sim.compose {state}\n"
                            f"stdout:\n{out}\nstderr:\n{err}")
            time.sleep(0.05)
        run.send_signal(sig)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 1, err
    assert "Traceback" not in err, err
    assert "stopping: KeyboardInterrupt" in err
    assert "all services stopped" in out
