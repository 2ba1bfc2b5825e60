"""A user-space network link: a TCP relay that adds one-way delay, jitter and a bandwidth cap each way.

Used by `make simulate --link ...` so each device reaches the server over its own emulated link, on
machines whose kernel lacks `tc netem` (and beside it when present). Bytes keep their order: jitter
moves release times but never reorders a stream, as a real link under TCP would.
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass


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
            values[key] = float(value)
        spec = cls(**values)
        if spec.delay_ms < 0 or spec.jitter_ms < 0 or (spec.rate_mbit is not None and spec.rate_mbit <= 0):
            raise ValueError(f"link settings must be positive: {text}")
        return spec


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
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, _Direction(self.spec, self.rng)),
                             self._pipe(up_reader, writer, _Direction(self.spec, self.rng)),
                             return_exceptions=True)

    def close(self) -> None:
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()
