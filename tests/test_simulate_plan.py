"""scripts/simulate.py's plan of the compose services, without running them (no model needed)."""

from pathlib import Path

import scripts.ports as ports
import scripts.simulate as simulate

ROOT = Path(__file__).resolve().parents[1]


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
