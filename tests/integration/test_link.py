"""Devices over emulated links: a client of each device's own reaches the server over its own TCP connection, so
`sled-bench system --link` gives every device its own link (gRPC shares one connection between channels of a process to
the same address unless told not to)."""

import asyncio
import time

from sim.linkemu import LinkEmulator, LinkSpec
from tests.conftest import all_freed, run


def test_own_connection_clients_each_get_a_link_and_pay_its_delay(make_server):
    from edge_client.transport import VerifierClient

    server = make_server()
    host, _, port = server.address.rpartition(":")

    async def infos(link_port: int, own: bool) -> float:
        clients = [VerifierClient(f"127.0.0.1:{link_port}", own_connection=own) for _ in range(3)]
        try:
            for c in clients:
                await c.info()
            t0 = time.perf_counter()
            await clients[0].info()  # connected: one round trip through the link
            return time.perf_counter() - t0
        finally:
            for c in clients:
                await c.close()

    own_link = LinkEmulator(LinkSpec(delay_ms=15), host, int(port))
    shared_link = LinkEmulator(LinkSpec(delay_ms=15), host, int(port))
    try:
        rtt = run(infos(own_link.port, own=True))
        run(infos(shared_link.port, own=False))
    finally:
        own_link.close()
        shared_link.close()
    assert own_link.connections == 3, own_link.connections
    assert shared_link.connections == 1, shared_link.connections  # why own_connection is needed
    assert rtt >= 0.03, rtt  # 15 ms each way


def test_closing_a_session_does_not_wait_a_round_trip_and_the_server_still_ends_it(make_server, tokenizer):
    import grpc

    from edge_client import codec
    from edge_client.request import Request
    from edge_client.transport import VerifierClient

    server = make_server()
    host, _, port = server.address.rpartition(":")
    link = LinkEmulator(LinkSpec(delay_ms=500), host, int(port))  # a round trip of 1 s

    async def session_closed() -> tuple[float, bool, object]:
        client = VerifierClient(f"127.0.0.1:{link.port}")
        try:
            t0 = time.perf_counter()
            asked = Request(tokenizer.encode("The capital of France is"), 4)
            session = await client.open(codec.open_message(asked, tokenizer.fingerprint))
            opened = time.perf_counter() - t0
            await session.close()
            answered = session.call.done()  # the server's Closed and the stream's end had come
        finally:
            await client.close()  # waits for the stream's end
        return opened, answered, await session.call.code()

    try:
        opened, answered, code = run(session_closed())
    finally:
        link.close()
    assert opened >= 1.0, opened  # the Open paid the round trip (the emulated link delays it by construction)
    # The Close did not: close() returned before the server's answer could come back over the link ...
    assert not answered
    assert code == grpc.StatusCode.OK  # ... and the server got the Close and ended the stream (not cancelled)
    assert all_freed(server)


def test_a_closed_session_whose_server_does_not_answer_in_time_is_cancelled_and_close_is_bounded(
        make_server, tokenizer, monkeypatch):
    import grpc

    from edge_client import codec, transport
    from edge_client.request import Request

    monkeypatch.setattr(transport, "DRAIN_TIMEOUT_S", 0.2)
    server = make_server()
    host, _, port = server.address.rpartition(":")
    link = LinkEmulator(LinkSpec(delay_ms=500), host, int(port))  # Closed comes 1 s after the Close goes out

    async def closed_late() -> tuple[object, float]:
        slow, quick = transport.VerifierClient(f"127.0.0.1:{link.port}"), None
        try:
            msg = codec.open_message(Request(tokenizer.encode("Water boils at"), 4), tokenizer.fingerprint)
            session = await slow.open(msg)
            await session.close()
            await asyncio.sleep(0.5)  # past the drain's 0.2 s, before the Closed could come
            drained = await session.call.code()
            # A client's close waits for its sessions' stream ends no longer than it is told to.
            quick = transport.VerifierClient(f"127.0.0.1:{link.port}")
            other = await quick.open(msg)
            await other.close()
            t0 = time.perf_counter()
            await quick.close(drain_timeout=0.05)
            return drained, time.perf_counter() - t0
        finally:
            await slow.close()
            if quick is not None:
                await quick.close()

    try:
        drained, closing = run(closed_late())
    finally:
        link.close()
    assert drained == grpc.StatusCode.CANCELLED  # the drain gave up and cancelled the call
    assert closing < 0.15, closing  # the Closed was 1 s away
    assert all_freed(server)  # the server freed both sessions
