"""The gRPC servicer: protobuf in, domain object, engine, protobuf out. Nothing else lives here."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging

import grpc

from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc

from . import codec
from .auth import Authenticator, peer_host
from .errors import SledError, invalid

log = logging.getLogger(__name__)


def _settle(fut: asyncio.Future, result: object, orphan=None) -> None:
    if fut.done():  # the asker was cancelled: what it asked for belongs to nobody
        if orphan is not None and not isinstance(result, BaseException):
            orphan(result)
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def _on_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Call fn(*args) on `loop` from the engine's thread; nothing where the loop has closed (the server stopped)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


async def _ask(method, *args, orphan=None):
    """Hand a message to the engine worker and await its answer (handlers never run model code). `orphan(result)`
    takes an answer that comes after the asker was cancelled, or that its cancellation kept it from reading (an
    opened session nobody will close otherwise)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    method(*args, lambda result: _on_loop(loop, _settle, fut, result, orphan))
    try:
        return await fut
    except asyncio.CancelledError:
        if orphan is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            orphan(fut.result())
        raise


class _Reader:
    """A stream's client messages, one at a time, where the next one can be awaited beside other work
    (`pending`) and then taken with `next` without losing it."""

    def __init__(self, request_iterator):
        self._it = request_iterator.__aiter__()
        self._pending: asyncio.Future | None = None

    def pending(self) -> asyncio.Future:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._it.__anext__())
        return self._pending

    async def next(self, within_s: float | None = None):
        """The next client message, or None once the client is done writing; a stream silent for `within_s` is
        ended. Without a pending read it reads directly: a task a message only where another wait needs it
        (`pending`)."""
        fut, self._pending = self._pending, None
        try:
            async with asyncio.timeout(within_s):  # no task a message, unlike wait_for
                return await (fut if fut is not None else self._it.__anext__())
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            raise SledError("DEADLINE_EXCEEDED", f"no Open on this stream within {within_s:g}s (the server's "
                                                 "idle_timeout_s): stream ended") from None

    def cancel(self) -> None:
        if self._pending is not None:
            if not self._pending.done():
                self._pending.cancel()
            # read its outcome, so a failed read (the client went away) is not reported as never retrieved
            self._pending.add_done_callback(lambda f: f.cancelled() or f.exception())


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, config, auth: Authenticator | None = None):
        self.config = config
        self.auth = auth if auth is not None else Authenticator(config.shared_token(), config.auth_tokens_file)
        self.engine = None  # set once the model is warm
        self.recent_peers: collections.deque[str] = collections.deque(maxlen=256)  # one entry per Open
        self.streams = 0  # Session streams being served

    def _engine(self):
        if self.engine is None:
            raise SledError("UNAVAILABLE", "the target model is still loading; retry when health says SERVING")
        return self.engine

    async def _identify(self, msg: pb.Open, context):
        peer = context.peer()
        identity = self.auth.identify(msg.auth_token, peer, context.auth_context())
        if identity is None:
            host = peer_host(peer)
            delay = self.auth.throttle.failure(host)
            log.warning("refused an Open from %s: %s (failure %d from that host, answered in %.2fs)", host,
                        "no auth_token" if not msg.auth_token else "an auth_token this server does not know",
                        self.auth.throttle.failures(host), delay)
            self.engine.metrics.auth_failures.inc()
            await asyncio.sleep(delay)
            raise SledError("UNAUTHENTICATED", "Open carries no valid auth_token for this server")
        target = self.engine.target
        if msg.tokenizer_fingerprint != target.fingerprint:
            client = msg.tokenizer_fingerprint or "no fingerprint"
            raise SledError(
                "FAILED_PRECONDITION",
                f"tokenizer mismatch: the device's vocabulary is {client}, the server's target "
                f"{target.name} has {target.fingerprint} ({target.vocab_size} tokens); "
                "draft with a model that shares the target's tokenizer",
            )
        return identity

    async def Session(self, request_iterator, context):
        engine = self._engine()
        cfg = self.config
        session = None
        decodes = False  # the server decodes this session itself (Open.server_decodes)
        reader = _Reader(request_iterator)
        self.streams += 1
        try:
            # A stream without a session is ended when silent; one with a session is not: its session is freed when
            # idle (Engine._sweep) and its next Draft told so.
            while (msg := await reader.next(cfg.idle_timeout_s if session is None else None)) is not None:
                kind = msg.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        raise SledError("FAILED_PRECONDITION", "this stream already holds a session; one Open per stream")
                    identity = await self._identify(msg.open, context)
                    # a constraint compiles off the event loop (a large schema takes seconds)
                    parse = functools.partial(codec.open_from_pb, msg.open, engine.vocab_size, cfg, identity,
                                              engine.grammars)
                    request = await asyncio.to_thread(parse) if msg.open.HasField("constraint") else parse()
                    decodes = request.server_decodes
                    verdicts: asyncio.Queue = asyncio.Queue()  # a session the server decodes: the engine's verdicts
                    loop = asyncio.get_running_loop()
                    push = (lambda v: _on_loop(loop, verdicts.put_nowait, v)) if decodes else None
                    session = await _ask(functools.partial(engine.open, request, on_verdict=push),
                                         orphan=lambda s: engine.close(s.id))
                    self.recent_peers.append(context.peer())
                    yield codec.opened_to_pb(session, cfg.max_draft_tokens, engine.vocab_size, cfg.max_seq_len,
                                             engine.target.name, decodes)
                    if decodes:
                        async for out in self._decode(verdicts, reader):
                            yield out
                elif kind == "draft":
                    if session is None:
                        raise SledError("FAILED_PRECONDITION", "send Open before the first Draft")
                    if msg.draft.session_id != session.id:
                        raise SledError("NOT_FOUND", f"unknown session {msg.draft.session_id!r}: this stream holds session {session.id}")
                    if decodes:
                        raise SledError("FAILED_PRECONDITION", f"session {session.id} is decoded by the server "
                                                               "(Open.server_decodes): send no Draft")
                    draft = codec.draft_from_pb(msg.draft, engine.vocab_size, cfg.max_draft_tokens, cfg.max_draft_top_k)
                    verdict = await _ask(engine.verify, session.id, draft)
                    yield codec.verdict_to_pb(verdict)
                elif kind == "close":
                    yield codec.closed_to_pb(session.generated if session else 0)
                    return
                else:
                    raise invalid("empty ClientMessage: set one of open, draft, close")
        finally:
            self.streams -= 1
            reader.cancel()
            if session is not None:
                engine.close(session.id)  # also when the client vanished: its KV slot is freed

    async def _decode(self, verdicts: asyncio.Queue, reader: "_Reader"):
        """Forward the Verdicts of a session the server decodes (the engine asks each next token itself) until one is
        finished or the client writes again (a Close, or anything else, which Session then answers)."""
        incoming = reader.pending()
        while True:
            if verdicts.empty() or incoming.done():
                getting = asyncio.ensure_future(verdicts.get())
                await asyncio.wait({getting, incoming}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():
                    getting.cancel()
                    return  # the client wrote: Session reads it
                verdict = getting.result()
            else:
                verdict = verdicts.get_nowait()
            if isinstance(verdict, BaseException):
                raise verdict
            yield codec.verdict_to_pb(verdict)
            if verdict.finished:
                return

    async def GetInfo(self, request, context):
        return codec.info_to_pb(self._engine(), self.config)


class Undecodable:
    """What a request deserializer gives for bytes that are not the method's message."""

    def __init__(self, error: Exception):
        self.error = error


def _safe(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, or anything a parser raises
            return Undecodable(err)

    return deserialize


def _refuse_undecodable(request, method: str, context):
    if isinstance(request, Undecodable):
        log.warning("undecodable %s message from %s: %s", method, peer_host(context.peer()), request.error)
        raise invalid(f"the message is not a valid {method} request ({request.error})")
    return request


async def _checked(request_iterator, method: str, context):
    async for request in request_iterator:
        yield _refuse_undecodable(request, method, context)


async def _abort_for(err: Exception, context, method: str) -> None:
    if isinstance(err, SledError):
        await context.abort(grpc.StatusCode[err.code], err.message)
    log.error("%s failed", method, exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err}")


class ExceptionInterceptor(grpc.aio.ServerInterceptor):
    """For every method: bytes that do not decode become INVALID_ARGUMENT (one log line, no traceback), SledError
    its gRPC status, and anything unexpected INTERNAL."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        deserializer = _safe(handler.request_deserializer) if handler.request_deserializer else None
        if handler.stream_stream is not None:
            inner = handler.stream_stream

            async def stream_stream(request_iterator, context):
                try:
                    async for response in inner(_checked(request_iterator, method, context), context):
                        yield response
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as err:  # noqa: BLE001
                    await _abort_for(err, context, method)

            return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, handler.response_serializer)
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner_unary(_refuse_undecodable(request, method, context), context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as err:  # noqa: BLE001
                    await _abort_for(err, context, method)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, handler.response_serializer)
        return handler
