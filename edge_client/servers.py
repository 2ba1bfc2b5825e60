"""A device's verify servers: one, a list, or every address a DNS name resolves to.

Each session opens on the first healthy server in this device's own order of them (rendezvous hashing of the
device's name), so a device's sessions stay on one server while it is healthy, and that server's prefix cache keeps
its system prompt, while devices spread over the fleet. Which servers are healthy is gRPC's business: each server's
channel runs gRPC's round_robin policy with client-side health checking (the servers' grpc.health.v1 service), so a
server that is down, still warming up or draining (NOT_SERVING) fails an Open at once and the next one is tried.
gRPC's round_robin over all servers would spread each device's sessions instead, and its hash-based policy needs xDS.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time

from sled.v1 import verify_pb2 as pb

from .transport import TLS, RemoteSession, VerifierClient, VerifyError

DNS_PREFIX = "dns:///"
# Errors after which a session is tried on the next server: it cannot be reached, or turns sessions away for now.
PASS_OVER = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED", "ABORTED", "UNKNOWN"})
# How long a DNS name's addresses are kept before it is resolved again (sooner where none of them answers).
RESOLVE_EVERY_S = 30.0
HEALTH_CHECKED = json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                             "healthCheckConfig": {"serviceName": pb.DESCRIPTOR.services_by_name["Verifier"].full_name}})


def _check_one(address: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"server must be HOST:PORT with a port in 1..65535, got {address!r}")
    return address


def split_servers(text: str) -> tuple[list[str], bool]:
    """The HOST:PORT entries of `text` (comma-separated, or one dns:///NAME:PORT) and whether it is a DNS name to
    resolve; a ValueError names what is wrong. gRPC would take a missing port as 443."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"server must be HOST:PORT, a comma-separated list of them or dns:///NAME:PORT, got {text!r}")
    if text.startswith(DNS_PREFIX):
        return [_check_one(text[len(DNS_PREFIX):])], True
    entries = [part.strip() for part in text.split(",")]
    if any(not e for e in entries):
        raise ValueError(f"server list {text!r} has an empty entry")
    if len(set(entries)) != len(entries):
        raise ValueError(f"server list {text!r} names a server twice")
    return [_check_one(e) for e in entries], False


def check_servers(text: str) -> str:
    split_servers(text)
    return text


def rendezvous_order(addresses: list[str], key: str) -> list[str]:
    """`addresses` in this key's own order (highest random weight first): stable for a key while the set is, and
    removing a server moves only the keys whose first choice it was."""
    def weight(address: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest()
    return sorted(addresses, key=weight, reverse=True)


async def resolve(name_port: str) -> list[str]:
    """Every address NAME resolves to, as HOST:PORT (IPv6 in brackets), in the resolver's order, once each."""
    host, _, port = name_port.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    out: list[str] = []
    for family, *_, sockaddr in infos:
        address = f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"
        if address not in out:
            out.append(address)
    return out


class ServerPool:
    """Several verify servers behind VerifierClient's interface (open, info, close)."""

    def __init__(self, servers: str, auth_token: str | None = None, tls: TLS | None = None, affinity: str = "",
                 own_connection: bool = False):
        self.address = servers
        self.auth_token = auth_token
        self.tls = tls is not None
        self._tls_settings = tls
        self._own_connection = own_connection
        self.affinity = affinity or socket.gethostname()
        entries, self._dns = split_servers(servers)
        self._name = entries[0] if self._dns else None
        self._addresses: list[str] = [] if self._dns else entries
        self._resolved_at = float("-inf")
        self._clients: dict[str, VerifierClient] = {}
        self.last_server: str | None = None  # where the last session opened

    def _client(self, address: str) -> VerifierClient:
        if address not in self._clients:
            self._clients[address] = VerifierClient(address, self.auth_token, self._own_connection,
                                                     self._tls_settings, service_config=HEALTH_CHECKED)
        return self._clients[address]

    async def servers(self, fresh: bool = False) -> list[str]:
        """The servers in this device's order; a DNS name is resolved again when its answer is old or `fresh`."""
        if self._dns and (fresh or time.monotonic() - self._resolved_at > RESOLVE_EVERY_S):
            try:
                self._addresses = await resolve(self._name)
                self._resolved_at = time.monotonic()
            except OSError as err:
                if not self._addresses:
                    raise VerifyError("UNAVAILABLE", f"cannot resolve {self._name}: {err}") from None
        return rendezvous_order(self._addresses, self.affinity)

    async def open(self, open_msg: pb.ClientMessage, timeout: float = 60.0,
                   wait_for_ready: bool = True) -> RemoteSession:
        """A session on the first server in this device's order that takes it. wait_for_ready is not used: a
        server that cannot take the session is passed over at once, and when none can, the caller's outage policy
        decides when to try again."""
        last: VerifyError | None = None
        for attempt in range(2):  # the second time with a DNS name's addresses resolved afresh
            for address in await self.servers(fresh=attempt > 0):
                try:
                    session = await self._client(address).open(open_msg, timeout=timeout, wait_for_ready=False)
                except VerifyError as err:
                    if err.code not in PASS_OVER:
                        raise
                    last = err
                    continue
                session.server = address
                self.last_server = address
                return session
            if not self._dns:
                break
        raise VerifyError(last.code if last else "UNAVAILABLE",
                          f"no verify server of {self.address} took the session (the last: "
                          f"{last.message if last else 'none resolved'})")

    async def info(self, timeout: float = 10.0) -> pb.ServerInfo:
        """The first answering server's Info, in this device's order."""
        last: VerifyError | None = None
        servers = await self.servers()
        for address in servers:
            try:
                return await self._client(address).info(timeout=timeout / max(1, len(servers)))
            except VerifyError as err:
                last = err
        raise VerifyError(last.code if last else "UNAVAILABLE",
                          f"no verify server of {self.address} answered ({last.message if last else 'none'})")

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients.values()))


def connect(servers: str, auth_token: str | None = None, tls: TLS | None = None, affinity: str = "",
            own_connection: bool = False) -> VerifierClient | ServerPool:
    """The device's way to its verify servers: a VerifierClient for one HOST:PORT, a ServerPool for a list or a
    dns:/// name."""
    entries, dns = split_servers(servers)
    if len(entries) == 1 and not dns:
        return VerifierClient(servers, auth_token, own_connection, tls)
    return ServerPool(servers, auth_token, tls, affinity, own_connection)
