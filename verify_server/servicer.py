"""The gRPC servicer: protobuf in, domain object, engine, protobuf out. Nothing else lives here."""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging

import grpc

from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc

from . import codec
from .errors import SledError, invalid
from .sessions import DraftRequest

log = logging.getLogger(__name__)


def _settle(fut: asyncio.Future, result: object) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


async def _ask(method, *args):
    """Hand a message to the engine worker and await its answer (handlers never run model code)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    method(*args, lambda result: loop.call_soon_threadsafe(_settle, fut, result))
    return await fut


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

    async def next(self):
        """The next client message, or None once the client is done writing. Without a pending read it reads
        directly: a task a message only where another wait needs it (`pending`)."""
        fut, self._pending = self._pending, None
        try:
            return await (fut if fut is not None else self._it.__anext__())
        except StopAsyncIteration:
            return None

    def cancel(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, config):
        self.config = config
        self.engine = None  # set once the model is warm
        self.recent_peers: collections.deque[str] = collections.deque(maxlen=256)  # one entry per Open

    def _engine(self):
        if self.engine is None:
            raise SledError("UNAVAILABLE", "the target model is still loading; retry when health says SERVING")
        return self.engine

    def _check_open(self, msg: pb.Open) -> None:
        token = self.config.auth_token
        if token and not hmac.compare_digest(msg.auth_token.encode(), token.encode()):
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

    async def Session(self, request_iterator, context):
        engine = self._engine()
        cfg = self.config
        session = None
        decodes = False  # the server decodes this session itself (Open.server_decodes)
        reader = _Reader(request_iterator)
        try:
            while (msg := await reader.next()) is not None:
                kind = msg.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        raise SledError("FAILED_PRECONDITION", "this stream already holds a session; one Open per stream")
                    self._check_open(msg.open)
                    request = codec.open_from_pb(msg.open, engine.vocab_size)
                    session = await _ask(engine.open, request)
                    self.recent_peers.append(context.peer())
                    decodes = request.server_decodes
                    yield codec.opened_to_pb(session, cfg.max_draft_tokens, engine.vocab_size, cfg.max_seq_len,
                                             engine.target.name, decodes)
                    if decodes:
                        async for out in self._decode(engine, session.id, reader):
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
            reader.cancel()
            if session is not None:
                engine.close(session.id)  # also when the client vanished: its KV slot is freed

    async def _decode(self, engine, session_id: str, reader: "_Reader"):
        """Decode every token of a session on the server (Open.server_decodes), a Verdict each, until one is
        finished or the client writes again (a Close, or anything else, which Session then answers). Each next
        token is asked of the engine before the last one's Verdict is written, so the session keeps its place in
        the engine's steps as a client on loopback would, and no network round trip comes between tokens."""
        round_ = 0
        asking = asyncio.ensure_future(_ask(engine.verify, session_id, DraftRequest.empty(round_)))
        try:
            while True:
                incoming = reader.pending()
                await asyncio.wait({asking, incoming}, return_when=asyncio.FIRST_COMPLETED)
                if not asking.done():
                    return  # the client wrote: Session reads it
                verdict = asking.result()
                if not verdict.finished:
                    round_ += 1
                    asking = asyncio.ensure_future(_ask(engine.verify, session_id, DraftRequest.empty(round_)))
                yield codec.verdict_to_pb(verdict)
                if verdict.finished:
                    return
        finally:
            if not asking.done():
                asking.cancel()

    async def GetInfo(self, request, context):
        engine = self._engine()
        cfg = self.config
        return codec.info_to_pb(engine.target.name, engine.target.fingerprint, engine.vocab_size, cfg.max_seq_len,
                                cfg.max_draft_tokens, cfg.max_sessions, sorted(engine.eos_ids), engine.stats(),
                                engine.kernels())


async def _abort_for(err: Exception, context, method: str) -> None:
    if isinstance(err, SledError):
        await context.abort(grpc.StatusCode[err.code], err.message)
    log.error("%s failed", method, exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err}")


class ExceptionInterceptor(grpc.aio.ServerInterceptor):
    """Turns SledError into its gRPC status and anything unexpected into INTERNAL, for every method."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.stream_stream is not None:
            inner = handler.stream_stream

            async def stream_stream(request_iterator, context):
                try:
                    async for response in inner(request_iterator, context):
                        yield response
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as err:  # noqa: BLE001
                    await _abort_for(err, context, method)

            return grpc.stream_stream_rpc_method_handler(stream_stream, handler.request_deserializer,
                                                         handler.response_serializer)
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner_unary(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as err:  # noqa: BLE001
                    await _abort_for(err, context, method)

            return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                       handler.response_serializer)
        return handler
