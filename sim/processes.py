"""Real processes for the benchmarks: a sled-server on a free loopback port, stopped however the run ends."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent


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


def exit_on_sigterm() -> None:
    """SIGTERM (`kill`, a job stopped by its runner) raises SystemExit in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so that `finally` blocks and `with` exits run: a killed benchmark stops the server it
    started instead of leaving it on the cores. A handler the program set itself is kept."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class ServerProcess:
    """`with ServerProcess("--max-sessions", "8") as address:` a real sled-server on a free loopback port."""

    def __init__(self, *flags: str, timeout: float = 300):
        self.flags, self.timeout = flags, timeout
        self.port = free_port()
        self.log = Path(tempfile.mkdtemp(prefix="sled-bench-")) / "server.log"

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        exit_on_sigterm()
        print(f"[bench] starting sled-server on port {self.port} (log {self.log})", flush=True)
        with open(self.log, "w") as out:
            # The installed entry point, or the module where SLED runs from a checkout (a GPU node without the venv).
            command = [str(BIN / "sled-server")] if (BIN / "sled-server").exists() else [sys.executable, "-m",
                                                                                         "verify_server.cli"]
            self.proc = subprocess.Popen([*command, "--port", str(self.port), *self.flags],
                                         stdout=out, stderr=subprocess.STDOUT)
        start = time.time()
        while "ready on" not in self.log.read_text():
            if self.proc.poll() is not None or time.time() - start > self.timeout:
                self.proc.kill()
                raise RuntimeError(f"sled-server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
