"""The simulation's emulated link: delay each way, order kept under jitter, bandwidth capped."""

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sim.linkemu import LinkEmulator, LinkProcess, LinkSpec


@pytest.fixture
def echo_port():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def roundtrip(port, payload: bytes) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        c.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += c.recv(65536)
        return got, time.perf_counter() - t0


def test_delay_applies_each_way(echo_port):
    link = LinkEmulator(LinkSpec(delay_ms=40), "127.0.0.1", echo_port)
    _, direct = roundtrip(echo_port, b"x")
    got, rtt = roundtrip(link.port, b"ping")
    link.close()
    assert got == b"ping" and rtt >= 0.08 > direct


def test_closing_the_link_cuts_its_connections_at_both_ends():
    """A link going down with data in flight: the server's side of each connection ends too, so the server ends what
    ran over it (a gRPC stream, its session), instead of holding a connection that will never carry anything."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    link = LinkEmulator(LinkSpec(delay_ms=300), "127.0.0.1", srv.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", link.port))
    server_side, _ = srv.accept()
    try:
        client.sendall(b"still on the wire when the link goes down")
        link.close()
        server_side.settimeout(5)
        try:
            got = server_side.recv(65536)
        except ConnectionResetError:
            got = b""
        assert got == b""  # the connection ended (without the cut: a 5 s timeout, the relay never writes again)
    finally:
        client.close()
        server_side.close()
        srv.close()


def test_jitter_never_reorders(echo_port):
    link = LinkEmulator(LinkSpec(delay_ms=5, jitter_ms=5), "127.0.0.1", echo_port)
    with socket.create_connection(("127.0.0.1", link.port)) as c:
        sent = b"".join(i.to_bytes(4, "big") for i in range(2000))
        for i in range(0, len(sent), 100):
            c.sendall(sent[i:i + 100])
        got = b""
        while len(got) < len(sent):
            got += c.recv(65536)
    link.close()
    assert got == sent


def test_rate_caps_bandwidth(echo_port):
    link = LinkEmulator(LinkSpec(rate_mbit=8), "127.0.0.1", echo_port)  # 1 MB/s each way
    _, seconds = roundtrip(link.port, b"y" * 500_000)
    link.close()
    assert seconds >= 0.45


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="unknown link setting"):
        LinkSpec.parse("latency=3")
    with pytest.raises(ValueError, match="positive"):
        LinkSpec.parse("rate_mbit=0")
    assert LinkSpec.parse("delay_ms=20,jitter_ms=5,rate_mbit=50") == LinkSpec(20, 5, 50)


def test_the_relay_process_carries_each_connection_over_its_own_link(echo_port):
    """sled-bench system --link runs the relay as a process of its own: each connection gets the delay each way."""
    spec = LinkSpec.parse("delay_ms=25,jitter_ms=5")
    assert LinkSpec.parse(spec.text()) == spec and spec.describe() == "25 ms ± 5 ms each way, no bandwidth cap"
    with LinkProcess(spec, "127.0.0.1", echo_port) as address:
        port = int(address.rsplit(":", 1)[1])
        (got_a, rtt_a), (got_b, rtt_b) = roundtrip(port, b"a"), roundtrip(port, b"bb")
    assert (got_a, got_b) == (b"a", b"bb") and min(rtt_a, rtt_b) >= 0.04, (rtt_a, rtt_b)  # 20-30 ms each way


def test_the_relay_process_reports_its_bytes_and_cpu(echo_port):
    relay = LinkProcess(LinkSpec(delay_ms=1), "127.0.0.1", echo_port)
    relay.start()
    roundtrip(int(relay.address.rsplit(":", 1)[1]), b"z" * 1000)
    assert relay.cpu_seconds() > 0.0  # its interpreter's start-up at least: read from /proc, not the 0.0 fallback
    relay.stop()
    assert relay.relayed == "relayed 2000 bytes" and relay.proc.returncode == 0


def test_the_relay_refuses_bad_settings_with_a_clear_error():
    script = Path(__file__).resolve().parents[2] / "sim" / "linkemu.py"
    for argv, message in ((["--link", "delay_ms=fast", "--to", "127.0.0.1:1"], "delay_ms must be a number"),
                          (["--link", "delay_ms=5", "--to", "nowhere"], "--to must be HOST:PORT")):
        done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_relay_whose_benchmark_was_killed_stops_by_itself(echo_port):
    """SIGKILL leaves no `finally` to stop the relay: it notices its parent is gone and ends."""
    import os
    import signal

    parent = subprocess.Popen(
        [sys.executable, "-c", "import time; "
         "from sim.linkemu import LinkProcess, LinkSpec; "
         f"r = LinkProcess(LinkSpec(delay_ms=1), '127.0.0.1', {echo_port}); r.start(); "
         "print(r.proc.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    relay = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and Path(f"/proc/{relay}").exists() and "Z" not in _state(relay):
        time.sleep(0.1)
    assert not Path(f"/proc/{relay}").exists() or "Z" in _state(relay), "the relay outlived its benchmark"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
