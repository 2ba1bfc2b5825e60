"""Free loopback ports for the processes the scripts and tests start (a server's gRPC and metrics ports)."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: all bound at once, then released. One at a time (bind, read, close), the kernel
    could hand the same port out again: a simulation run once gave the server's gRPC and metrics ports the same
    number, the server never became healthy, and the run waited out its timeout."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
