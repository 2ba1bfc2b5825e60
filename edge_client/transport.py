"""gRPC transport to the verify server: one channel, one bidirectional stream per session."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc

from . import codec
from .drafters.base import Proposal


CORE_WRITE_FAILED = "Internal error from Core"
# How long a closed session's stream end (the server's Closed, then its status) is waited for in the background.
DRAIN_TIMEOUT_S = 10.0


class VerifyError(Exception):
    """The server refused or the link failed; `code` is the gRPC status code name."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def unreachable(self) -> bool:
        """The server could not be reached (or did not answer in time), as against a refusal."""
        return self.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    @property
    def summary(self) -> str:
        """The error as a command line reports it: a refusal says so, a lost link speaks for itself."""
        return str(self) if self.unreachable else f"the server refused: {self}"

    def hinted(self, tls: bool) -> "VerifyError":
        """This error, with a hint where the likely cause is TLS on one side only (gRPC's own words do not say so)."""
        if self.code != "UNAVAILABLE":
            return self
        if not tls and "Socket closed" in self.message:
            hint = "a server that speaks TLS closes a plain connection this way: if it does, set tls (--tls)"
        elif tls and "WRONG_VERSION_NUMBER" in self.message:
            hint = "the server does not seem to speak TLS: if so, leave tls off"
        elif tls and "Socket closed" in self.message:
            # TLS 1.3: the server checks the device's certificate after the device has finished its handshake, so
            # a missing or untrusted one only closes the connection
            hint = ("a server that requires client certificates closes the connection this way where the device "
                    "presents none (tls_cert, tls_key) or one it does not trust")
        else:
            return self
        return VerifyError(self.code, f"{self.message} ({hint})")

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError) -> "VerifyError":
        code, details = err.code().name, err.details() or ""
        if code == "INTERNAL" and details == CORE_WRITE_FAILED:
            # grpc.aio reports a write on a stream that Core has already closed (the server went away or is
            # shutting down) as this INTERNAL, hiding the stream's real status (grpc/grpc#36066): a lost link.
            return cls("UNAVAILABLE", f"the stream closed under a write ({details})")
        return cls(code, details)


def read_client_pair(cert: str | Path, key: str | Path) -> tuple[bytes, bytes]:
    """The device's own PEM certificate chain and private key (mutual TLS), checked as a pair the way Python's own
    TLS reads them: gRPC would only fail each handshake."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(cert), str(key))
        return Path(cert).read_bytes(), Path(key).read_bytes()
    except OSError as err:  # ssl.SSLError is one: a missing file, no PEM in it, a key that is not the certificate's
        raise ValueError(f"tls_cert {cert} and tls_key {key}: not a usable certificate and key "
                         f"({err.strerror or err})") from None


def read_ca(path: str | Path) -> bytes:
    """The PEM CA certificates in `path`, checked the way Python's own TLS reads them: a missing file or one
    without a certificate is a ValueError that names it (gRPC would only fail each handshake)."""
    try:
        ssl.create_default_context(cafile=str(path))
        return Path(path).read_bytes()
    except OSError as err:  # ssl.SSLError is one
        raise ValueError(f"tls_ca {path}: cannot read CA certificates from it ({err.strerror or err})") from None


@dataclass(frozen=True)
class TLS:
    """A verify server reached over TLS: the PEM CA certificates to trust (None: the system's), the name its
    certificate must carry where that is not the host of the address (a server reached by IP address), and the
    device's own PEM certificate chain and private key for a server that requires them (mutual TLS; None: none)."""

    ca: bytes | None = None
    server_name: str | None = None
    cert_chain: bytes | None = None
    key: bytes | None = None

    @classmethod
    def load(cls, ca_file: str | Path | None = None, server_name: str | None = None,
             cert_file: str | Path | None = None, key_file: str | Path | None = None) -> "TLS":
        if (cert_file is None) != (key_file is None):
            raise ValueError("tls_cert and tls_key go together: give both (a client certificate) or neither")
        chain, key = read_client_pair(cert_file, key_file) if cert_file is not None else (None, None)
        return cls(read_ca(ca_file) if ca_file is not None else None, server_name or None, chain, key)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, private_key=self.key, certificate_chain=self.cert_chain)


class VerifierClient:
    def __init__(self, address: str, auth_token: str | None = None, own_connection: bool = False,
                 tls: TLS | None = None, service_config: str | None = None):
        """own_connection: a TCP connection of this client's own, not shared with other channels of this process to
        the same address (gRPC shares them by default): each replayed device of a benchmark over its own link.
        tls: reach the server over TLS (None: a plain connection, as the server listens by default).
        service_config: gRPC's service config for the channel (JSON), e.g. client-side health checking."""
        self.address = address
        self.auth_token = auth_token
        self.tls = tls is not None
        options = [
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 30_000),
            # gRPC's own reconnect backoff grows to 120 s by default: a server back after a long outage would be
            # found that late by an Open waiting for it. Capped near the generation loop's own backoff (4 s).
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 4_000),
            *([("grpc.use_local_subchannel_pool", 1)] if own_connection else []),
            *([("grpc.service_config", service_config)] if service_config else []),
        ]
        if tls is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self.channel = grpc.aio.secure_channel(address, tls.credentials(), options=options)
        self.stub = pb_grpc.VerifierStub(self.channel)
        # Closed sessions whose stream end is still being read (RemoteSession.close); close() waits for them.
        self._draining: set[asyncio.Task] = set()

    async def info(self, timeout: float = 10.0) -> pb.ServerInfo:
        try:
            return await self.stub.GetInfo(pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise VerifyError.from_rpc(err).hinted(self.tls) from None
        # Waiting for the server hides why each connection failed (nothing listens, a TLS handshake refused): one
        # attempt that does not wait says it, or finds a server that has just come up.
        try:
            return await self.stub.GetInfo(pb.InfoRequest(), timeout=min(1.0, timeout), wait_for_ready=False)
        except grpc.aio.AioRpcError as err:
            last = VerifyError.from_rpc(err).hinted(self.tls)
            raise VerifyError("DEADLINE_EXCEEDED", f"the last connection attempt: {last}") from None

    async def open(self, open_msg: pb.ClientMessage, timeout: float = 60.0,
                   wait_for_ready: bool = True) -> "RemoteSession":
        session = RemoteSession(self.stub.Session(wait_for_ready=wait_for_ready), self._draining)
        try:
            await session.open(open_msg, timeout)
        except VerifyError as err:
            raise err.hinted(self.tls) from None
        return session

    async def close(self, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Close the channel once the sessions closed on it have seen their stream end (at most drain_timeout s)."""
        if self._draining:
            await asyncio.wait(set(self._draining), timeout=drain_timeout)
        await self.channel.close()


async def fetch_info(address: str, timeout: float = 10.0, tls: TLS | None = None) -> pb.ServerInfo:
    """One server's Info over a channel of its own (`sled-edge info`, the benchmarks)."""
    client = VerifierClient(address, tls=tls)
    try:
        return await client.info(timeout=timeout)
    finally:
        await client.close()


class RemoteSession:
    def __init__(self, call, draining: set[asyncio.Task]):
        """draining: the client's set of closed sessions' stream-end reads (VerifierClient.close waits for them)."""
        self.call = call
        self.opened: codec.Opened | None = None
        self.server: str | None = None  # the server it opened on, where the client has several
        self._draining = draining

    async def _ended(self) -> VerifyError:
        code = await self.call.code()
        details = await self.call.details()
        return VerifyError(code.name if code else "UNKNOWN", details or "the server ended the stream")

    async def _exchange(self, msg: pb.ClientMessage | None) -> pb.ServerMessage:
        """Write `msg` (None: nothing) and read the server's next message."""
        try:
            if msg is not None:
                await self.call.write(msg)
            reply = await self.call.read()
        except grpc.aio.AioRpcError as err:
            raise VerifyError.from_rpc(err) from None
        except asyncio.InvalidStateError:  # the call had already ended (server gone, stream cancelled)
            raise await self._ended() from None
        if reply is grpc.aio.EOF:
            raise await self._ended()
        return reply

    async def open(self, open_msg: pb.ClientMessage, timeout: float) -> codec.Opened:
        try:
            self.opened = codec.opened_from(await asyncio.wait_for(self._exchange(open_msg), timeout))
        except asyncio.TimeoutError:
            self.call.cancel()
            raise VerifyError("DEADLINE_EXCEEDED", f"no Opened from the server within {timeout:.1f}s") from None
        return self.opened

    async def verify(self, round_: int, proposal: Proposal) -> codec.Verdict:
        return codec.verdict_from(await self._exchange(codec.draft_message(self.opened.session_id, round_, proposal)))

    async def next_verdict(self) -> codec.Verdict:
        """The next token's Verdict of a session the server decodes itself (Opened.server_decodes): nothing is written."""
        return codec.verdict_from(await self._exchange(None))

    async def close(self) -> None:
        """End the session without waiting on the server: Close and the end of writing go out now, and the server's
        Closed and the stream's end are read in the background (`_drain`). Nothing the device needs comes with them,
        so a generation ends when its last verdict comes, not one round trip later."""
        try:
            await self.call.write(codec.close_message())
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the stream had already ended: nothing left to read
        task = asyncio.ensure_future(self._drain(DRAIN_TIMEOUT_S))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain(self, timeout: float) -> None:
        """Read the stream to its end (the server's Closed); a server that does not end it in time gets it cancelled."""

        async def to_end() -> None:
            while await self.call.read() is not grpc.aio.EOF:
                pass

        try:
            await asyncio.wait_for(to_end(), timeout)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        except asyncio.TimeoutError:
            self.call.cancel()
        except asyncio.CancelledError:
            self.call.cancel()
            raise

    def cancel(self) -> None:
        self.call.cancel()
