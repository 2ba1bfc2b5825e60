"""make simulate's plan of the compose services (sim/compose.py), without running them (no model needed)."""

import subprocess
import sys
from pathlib import Path

import pytest

import sim.processes as ports
from sim import compose as simulate

ROOT = Path(__file__).resolve().parents[2]


def test_the_services_get_distinct_ports_though_the_kernel_reuses_a_released_one(monkeypatch):
    """The kernel may hand out a port just released again: chosen one at a time (bind, read, close), the server's
    gRPC and metrics ports once came out the same, the server never became healthy and the run waited out its
    timeout. Here a socket stand-in gives the lowest port not bound at that moment, the kernel's reuse at its most
    eager: every port of the plan must still differ."""
    bound: set[int] = set()

    class Socket:
        def __init__(self, *args):
            self.port = None

        def bind(self, address):
            self.port = min(p for p in range(40000, 40100) if p not in bound)
            bound.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            bound.discard(self.port)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(ports.socket, "socket", Socket)
    plan = simulate.Plan(simulate.load_compose(ROOT / "docker-compose.yml"))
    assert len(plan.ports) >= 2 and len(set(plan.ports.values())) == len(plan.ports), plan.ports
    assert plan.ports[("verify-server", 50051)] != plan.ports[("verify-server", 9400)]


def test_a_signal_that_arrives_inside_a_destructor_still_stops_the_run(monkeypatch):
    """A Ctrl-C once came while Python ran a freed gRPC channel's __del__: the handler's KeyboardInterrupt was
    printed and dropped there, the handler had already turned further signals off, and the run waited on. The
    handler now only records the signal, and the run's own waits (`pause`) raise it."""
    import signal

    monkeypatch.setattr(simulate, "_stop", [])
    monkeypatch.setattr(simulate, "hold_signals", lambda: None)  # leave pytest's own handlers alone

    class Freed:
        def __del__(self):
            simulate.interrupted(signal.SIGINT, None)

    Freed()  # freed at once: its __del__ takes the signal, and whatever it raised would be dropped
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        simulate.pause(5)


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(timeout):
    done = subprocess.run([sys.executable, "-m", "sim.compose", "--timeout", timeout],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--timeout must be positive" in done.stderr



@pytest.mark.parametrize("text, after_path", [
    (": :\n", ", line 1, column 1: not valid YAML (expected <block end>, but found ':')"),
    ("[1]\n", " has no services"),
    ("services: [1]\n", ": services must be a mapping of names to services, got list"),
])
def test_a_compose_file_of_the_wrong_shape_is_a_clear_error(tmp_path, text, after_path):
    f = tmp_path / "compose.yml"
    f.write_text(text)
    with pytest.raises(ValueError) as err:
        simulate.load_compose(f)
    assert str(err.value) == f"{f}{after_path}"


def test_the_fleet_profile_adds_a_second_server_and_devices_that_take_both():
    plain = simulate.load_compose(ROOT / "docker-compose.yml")
    fleet = simulate.load_compose(ROOT / "docker-compose.yml", ("fleet",))
    assert "verify-server-b" not in plain and "device-fleet-a" not in plain
    assert set(plain) < set(fleet) and {"verify-server-b", "device-fleet-a", "device-fleet-b"} <= set(fleet)
    plan = simulate.Plan(fleet)
    command = plan.command("device-fleet-a")
    servers = command[command.index("--server") + 1].split(",")
    assert servers == [f"127.0.0.1:{plan.grpc_port('verify-server')}", f"127.0.0.1:{plan.grpc_port('verify-server-b')}"]
    assert plan.grpc_port("verify-server") != plan.grpc_port("verify-server-b")
    with pytest.raises(ValueError, match="no profile gpu"):
        simulate.load_compose(ROOT / "docker-compose.yml", ("gpu",))
