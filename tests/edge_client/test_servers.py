"""A device's list of verify servers: parsing, its own stable order of them, the YAML and CLI forms."""

import asyncio

import pytest

from edge_client.config import load_edge_config
from edge_client.servers import ServerPool, connect, rendezvous_order, split_servers
from edge_client.transport import VerifierClient


@pytest.mark.parametrize("text, want", [
    ("a:1", (["a:1"], False)),
    ("10.0.0.1:50051, 10.0.0.2:50051", (["10.0.0.1:50051", "10.0.0.2:50051"], False)),
    ("dns:///sled-verify.sled.svc.cluster.local:50051", (["sled-verify.sled.svc.cluster.local:50051"], True)),
])
def test_servers_are_a_host_port_a_list_or_a_dns_name(text, want):
    assert split_servers(text) == want


@pytest.mark.parametrize("text, error", [
    ("a:1,,b:2", "empty entry"),
    ("a:1,a:1", "names a server twice"),
    ("a:1,b", "HOST:PORT"),
    ("dns:///name", "HOST:PORT"),
    ("", "HOST:PORT"),
])
def test_a_bad_server_list_is_named(text, error):
    with pytest.raises(ValueError, match=error):
        split_servers(text)


def test_each_device_has_its_own_stable_order_and_a_lost_server_moves_only_its_devices():
    servers = [f"10.0.0.{i}:50051" for i in range(1, 6)]
    devices = [f"device-{i}" for i in range(200)]
    first = {d: rendezvous_order(servers, d)[0] for d in devices}
    assert first == {d: rendezvous_order(list(reversed(servers)), d)[0] for d in devices}  # not the list's order
    assert len(set(first.values())) == 5 and max(list(first.values()).count(s) for s in servers) < 80  # spread
    gone = servers[2]
    after = {d: rendezvous_order([s for s in servers if s != gone], d)[0] for d in devices}
    moved = {d for d in devices if after[d] != first[d]}
    assert moved == {d for d in devices if first[d] == gone}  # only the lost server's devices move
    assert all(after[d] == rendezvous_order(servers, d)[1] for d in moved)  # each to its own second choice


def test_one_server_is_a_plain_client_and_several_a_pool():
    async def kinds():  # grpc.aio channels are made inside the event loop that uses them
        clients = [connect("127.0.0.1:50051"), connect("127.0.0.1:1,127.0.0.1:2", affinity="x"),
                   connect("dns:///localhost:50051")]
        for client in clients:
            await client.close()
        return clients

    one, pool, named = asyncio.run(kinds())
    assert isinstance(one, VerifierClient)
    assert isinstance(pool, ServerPool) and pool.affinity == "x"
    assert isinstance(named, ServerPool)


def test_the_yaml_takes_a_list_of_servers(tmp_path):
    path = tmp_path / "device.yaml"
    path.write_text("server: [10.0.0.1:50051, 10.0.0.2:50051]\n")
    assert load_edge_config(path).server == "10.0.0.1:50051,10.0.0.2:50051"
    path.write_text("server: [10.0.0.1:50051, 7]\n")
    with pytest.raises(ValueError, match="list of them"):
        load_edge_config(path)
    path.write_text("server: 10.0.0.1:50051,nope\n")
    with pytest.raises(ValueError, match="HOST:PORT"):
        load_edge_config(path)
