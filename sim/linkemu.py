"""A user-space network link: a TCP relay that adds one-way delay, jitter and a bandwidth cap each way.

Used by `make simulate --link ...` so each device reaches the server over its own emulated link, on
machines whose kernel lacks `tc netem` (and beside it when present), and by `sled-bench system
--link ...`, which runs it as a process of its own (`LinkProcess`). Every TCP connection through the
relay is its own link. Bytes keep their order: jitter moves release times but never reorders a stream,
as a real link under TCP would.

    python -m sim.linkemu --link delay_ms=20,jitter_ms=5,rate_mbit=50 --to 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LinkSpec:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float | None = None

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """'delay_ms=20,jitter_ms=5,rate_mbit=50'"""
        values = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition("=")
            if key not in ("delay_ms", "jitter_ms", "rate_mbit"):
                raise ValueError(f"unknown link setting {key!r}: use delay_ms, jitter_ms, rate_mbit")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"link setting {key} must be a number, got {value!r}") from None
        spec = cls(**values)
        if spec.delay_ms < 0 or spec.jitter_ms < 0 or (spec.rate_mbit is not None and spec.rate_mbit <= 0):
            raise ValueError(f"link settings must be positive: {text}")
        return spec

    def text(self) -> str:
        """The form parse() reads."""
        return ",".join(f"{k}={v:g}" for k, v in (("delay_ms", self.delay_ms), ("jitter_ms", self.jitter_ms),
                                                   ("rate_mbit", self.rate_mbit)) if v is not None)

    def describe(self) -> str:
        """'20 ms ± 5 ms each way, 50 Mbit/s'"""
        words = f"{self.delay_ms:g} ms" + (f" ± {self.jitter_ms:g} ms" if self.jitter_ms else "") + " each way"
        return words + (f", {self.rate_mbit:g} Mbit/s" if self.rate_mbit else ", no bandwidth cap")


class _Direction:
    def __init__(self, spec: LinkSpec, rng: random.Random):
        self.spec, self.rng = spec, rng
        self.busy_until = 0.0
        self.last_release = 0.0

    def release_time(self, now: float, nbytes: int) -> float:
        start = max(now, self.busy_until)
        if self.spec.rate_mbit:
            start += nbytes * 8 / (self.spec.rate_mbit * 1e6)
        self.busy_until = start
        delay = self.spec.delay_ms + self.rng.uniform(-self.spec.jitter_ms, self.spec.jitter_ms)
        self.last_release = max(self.last_release, start + max(delay, 0.0) / 1000.0)
        return self.last_release


class LinkEmulator:
    """Listens on listen_host:listen_port (0 picks one) and relays to target_host:target_port."""

    def __init__(self, spec: LinkSpec, target_host: str, target_port: int, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, seed: int = 0):
        self.spec, self.target = spec, (target_host, target_port)
        self.listen = (listen_host, listen_port)
        self.rng = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self.bytes = 0
        self.connections = 0  # accepted so far, each its own link
        self._writers: set[asyncio.StreamWriter] = set()  # both ends of every open connection, cut on close()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, *self.listen))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _pipe(self, reader, writer, direction: _Direction) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def sender():
            while (item := await queue.get()) is not None:
                at, data = item
                await asyncio.sleep(max(0.0, at - self.loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.create_task(sender())
        try:
            while data := await reader.read(65536):
                self.bytes += len(data)
                queue.put_nowait((direction.release_time(self.loop.time(), len(data)), data))
        except ConnectionError:
            pass
        queue.put_nowait(None)
        await task

    async def _client(self, reader, writer) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer, _Direction(self.spec, self.rng)),
                                 self._pipe(up_reader, writer, _Direction(self.spec, self.rng)),
                                 return_exceptions=True)
        finally:
            self._writers -= {writer, up_writer}

    def close(self) -> None:
        """Stop relaying and cut every connection at both ends, as a link going down does: the server sees its
        connections end (and ends their streams) instead of keeping them open with what was in flight lost."""

        async def cancel_all():
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


class LinkProcess:
    """The relay in a process of its own (`with LinkProcess(spec, host, port) as address:`), so that it shares no
    interpreter lock with the clients it carries; `cpu_seconds()` is the CPU time it has taken so far."""

    def __init__(self, spec: LinkSpec, target_host: str, target_port: int, seed: int = 0, timeout: float = 30.0):
        self.spec, self.target, self.seed, self.timeout = spec, (target_host, target_port), seed, timeout
        self.proc: subprocess.Popen | None = None
        self.address = ""  # where it listens, once started
        self.relayed = ""

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        """Starts the relay and returns the address it listens on."""
        # Its errors go to a file, not a pipe nobody reads while it runs: a full pipe would stall the relay.
        self.errors = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--link", self.spec.text(), "--to", f"{self.target[0]}:{self.target[1]}",
             "--seed", str(self.seed), "--parent", str(os.getpid())], stdout=subprocess.PIPE, stderr=self.errors,
            text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout)
        if not line or not line[0].startswith("listening on "):
            self.proc.kill()
            self.proc.communicate(timeout=10)
            self.errors.seek(0)
            err = self.errors.read().strip()[-2000:]
            self.errors.close()
            raise RuntimeError(f"the link relay did not start: {err}")
        self.address = line[0].split()[-1]
        return self.address

    def cpu_seconds(self) -> float:
        """User and system CPU time of the relay process so far (Linux /proc; 0.0 where it cannot be read)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError, AttributeError):
            return 0.0

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                out, _ = self.proc.communicate(timeout=10)
                self.relayed = out.strip()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        self.errors.close()  # also where the relay had already ended


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Relay TCP connections to HOST:PORT through an emulated link (one-way delay and jitter each way, "
                    "a bandwidth cap), every connection its own link, until stopped (SIGTERM or Ctrl-C). Prints "
                    "'listening on HOST:PORT' once ready, and the bytes relayed on exit.")
    ap.add_argument("--link", required=True, metavar="SPEC",
                    help="delay_ms=D,jitter_ms=J,rate_mbit=R (each optional; delay and jitter apply each way)")
    ap.add_argument("--to", required=True, metavar="HOST:PORT", help="where connections are relayed")
    ap.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                    help="where to listen (default %(default)s: a free loopback port)")
    ap.add_argument("--seed", type=int, default=0, help="the jitter's random seed (default %(default)s)")
    ap.add_argument("--parent", type=int, metavar="PID",
                    help="the PID of the process that starts it: it stops too once that one is gone (LinkProcess "
                         "passes its own, so a relay left behind by a killed benchmark stops within a second)")
    args = ap.parse_args(argv)
    try:
        spec = LinkSpec.parse(args.link)
    except ValueError as err:
        ap.error(f"--link: {err}")
    addresses = []
    for flag, value in (("--to", args.to), ("--listen", args.listen)):
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            ap.error(f"{flag} must be HOST:PORT, got {value!r}")
        addresses.append((host, int(port)))
    (to_host, to_port), (listen_host, listen_port) = addresses
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    link = LinkEmulator(spec, to_host, to_port, listen_host, listen_port, seed=args.seed)
    if link.port is None:
        print(f"could not listen on {args.listen}", file=sys.stderr)
        return 1
    print(f"listening on {listen_host}:{link.port}", flush=True)
    while not stop.wait(0.5):
        if args.parent is not None and os.getppid() != args.parent:
            break  # the process that started it is gone
    link.close()
    print(f"relayed {link.bytes} bytes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
