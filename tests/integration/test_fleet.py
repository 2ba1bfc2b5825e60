"""Several verify servers, one fleet: a device opens each session on a healthy server, keeps to one while it stays
healthy, and moves when it drains or dies; with three server processes, one killed and one drained mid-run, six
devices finish with the target's greedy text and the survivors' slots come back empty."""

import asyncio
import signal
import subprocess
import threading
import time

import pytest
from grpc_health.v1 import health_pb2

from sim.processes import BIN, free_ports
from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.generation import generate
from edge_client.request import Callbacks, Request
from edge_client.policy import DraftPolicy
from edge_client.resilience import Resilience
from edge_client.servers import ServerPool, rendezvous_order
from edge_client.transport import fetch_info
from sled.v1 import verify_pb2 as pb
from tests.conftest import PROMPTS, all_freed

pytestmark = pytest.mark.model


async def open_on(pool: ServerPool, fingerprint: str) -> str:
    """Open a session through the pool, close it, and say which server took it."""
    session = await pool.open(pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=fingerprint,
                                                            context_token_ids=[1, 2, 3], max_tokens=4)), timeout=30)
    await session.close()
    return session.server


def until(condition, within_s: float = 20.0) -> bool:
    """Whether `condition()` holds within `within_s` (health changes reach the device through a watch stream)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_device_keeps_to_one_healthy_server_and_moves_when_it_drains_or_dies(make_tiny_server, tiny):
    servers = {s.address: s for s in (make_tiny_server() for _ in range(3))}
    addresses = list(servers)
    order = rendezvous_order(addresses, "device-a")
    home, second = servers[order[0]], servers[order[1]]
    loop = asyncio.new_event_loop()
    pool = ServerPool(",".join(addresses), affinity="device-a")

    def where() -> str:
        return loop.run_until_complete(open_on(pool, tiny.fingerprint))

    try:
        assert [where() for _ in range(6)] == [order[0]] * 6  # sticky: every session on the device's own server
        # devices spread over the fleet
        firsts = {rendezvous_order(addresses, f"device-{i}")[0] for i in range(12)}
        assert len(firsts) >= 2
        # the home server says NOT_SERVING (unhealthy): new sessions go to the device's second choice ...
        def health(status):
            for name in ("", "sled.v1.Verifier"):
                home.call(home.server.health.set(name, status))
        health(health_pb2.HealthCheckResponse.NOT_SERVING)
        assert until(lambda: where() == order[1])
        # ... and when it is SERVING again, home, where its prefix cache is
        health(health_pb2.HealthCheckResponse.SERVING)
        assert until(lambda: where() == order[0])
        # the home server drains (as SIGTERM makes it): the second choice
        home.call(home.server.health.enter_graceful_shutdown())
        assert until(lambda: where() == order[1])
        # the second dies too: the third
        second.stop()
        assert until(lambda: where() == order[2])
        assert all_freed(home) and all_freed(servers[order[2]])
        registry = servers[order[2]].engine.metrics.registry  # what the fleet's dashboard reads
        assert registry.get_sample_value("sled_free_slots") == 8 == servers[order[2]].engine.free_sessions()
    finally:
        loop.run_until_complete(pool.close())
        loop.close()


def test_a_refusal_that_is_not_about_availability_is_not_tried_elsewhere(make_tiny_server, tiny):
    from edge_client.transport import VerifyError

    servers = [make_tiny_server() for _ in range(2)]
    pool = ServerPool(",".join(s.address for s in servers), affinity="device-a")

    async def go():
        try:
            await pool.open(pb.ClientMessage(open=pb.Open(tokenizer_fingerprint="wrong", context_token_ids=[1],
                                                          max_tokens=4)), timeout=30)
        finally:
            await pool.close()

    with pytest.raises(VerifyError) as err:
        asyncio.run(go())
    assert err.value.code == "FAILED_PRECONDITION"
    assert "no verify server" not in err.value.message  # the server's own refusal, not a list of failures


def start_servers(n: int, tmp_path) -> list[tuple[subprocess.Popen, str, object]]:
    ports = free_ports(n)
    started = []
    for port in ports:
        log = tmp_path / f"server-{port}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([BIN / "sled-server", "--port", str(port), "--max-sessions", "8",
                                     "--max-seq-len", "512", "--fused-max-tokens", "64", "--threads", "1"],
                                    stdout=out, stderr=subprocess.STDOUT)
        started.append((proc, f"127.0.0.1:{port}", log))
    for proc, _, log in started:
        assert until(lambda: "ready on" in log.read_text() or proc.poll() is not None, 240), log.read_text()
        assert proc.poll() is None, log.read_text()
    return started


def test_six_devices_lose_nothing_when_one_of_three_servers_is_killed_and_another_drained(tmp_path, tokenizer,
                                                                                          reference_greedy):
    servers = start_servers(3, tmp_path)
    procs = {address: proc for proc, address, _ in servers}
    fleet = ",".join(procs)
    max_tokens = 64
    prompts = [tokenizer.encode(PROMPTS[i]) for i in (1, 2, 7, 10, 15, 21)]  # none ends before max_tokens
    pools = [ServerPool(fleet, affinity=f"device-{i}") for i in range(len(prompts))]
    progress = [0] * len(prompts)  # text pieces out, per device
    finished = [False] * len(prompts)
    statuses: list[str] = []
    killed: list[str] = []
    hits: list[int] = []  # running devices on each server as it was killed or drained

    def events():
        """Once every device has text out, kill the server most running devices are on; once the devices have
        committed more since, drain the server most of the still-running ones are on."""
        until(lambda: min(progress) >= 6 or all(finished), 300)
        for sig in (signal.SIGKILL, signal.SIGTERM):
            alive = [a for a in procs if a not in killed]
            on = {a: sum(p.last_server == a for p, done in zip(pools, finished) if not done) for a in alive}
            victim = max(alive, key=lambda a: on[a])
            hits.append(on[victim])
            procs[victim].send_signal(sig)
            killed.append(victim)
            mark = sum(progress)
            until(lambda: sum(progress) >= mark + 30 or all(finished), 300)

    async def device(i: int):
        drafter = create_drafter("ngram", DrafterOptions())

        def seen(piece, verified):
            progress[i] += 1

        try:
            return await generate(
                pools[i],
                drafter,
                tokenizer,
                Request(
                    prompts[i],
                    max_tokens=max_tokens,
                    policy=DraftPolicy(draft_tokens=4, adaptive=False),
                    client_id=f"device-{i}",
                ),
                resilience=Resilience(wait_deadline_s=120.0, round_timeout_s=20.0),
                callbacks=Callbacks(on_text=seen, on_status=statuses.append),
            )
        finally:
            finished[i] = True
            await pools[i].close()
            drafter.close()

    async def all_devices():
        return await asyncio.gather(*(device(i) for i in range(len(prompts))))

    chaos = threading.Thread(target=events, daemon=True)
    chaos.start()
    try:
        results = asyncio.run(all_devices())
        chaos.join(timeout=60)
        assert len(killed) == 2 and min(hits) >= 1, (hits, statuses)
        for prompt, result in zip(prompts, results):
            assert result.token_ids == reference_greedy(tuple(prompt), max_tokens)
            assert result.unverified_tokens == 0
        assert sum(r.reconnects for r in results) >= 1  # some device was moved off a lost server
        survivor = next(a for a in procs if a not in killed)

        async def slots():
            return (await fetch_info(survivor, timeout=10)).stats

        stats = asyncio.run(slots())
        assert stats.active_sessions == 0 and stats.free_slots == 8
        assert procs[killed[1]].wait(timeout=60) == 0  # the drained server exits cleanly
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
