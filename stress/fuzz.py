"""Random message sequences against a real verify server, cancelled at random points (hypothesis).

Each example runs one to four streams at once. A stream is a list of actions: valid and broken Opens, Drafts and
Closes, empty messages, bytes that decode to nothing, a half-close, a cancel. The property: no call ends INTERNAL or
UNKNOWN, every call ends (the server answers or ends each stream within --call-timeout), and once all are done every
KV slot is free. `tests/integration/test_fuzz.py` runs a few examples on each `make test`; this command runs many.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import grpc
import hypothesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sled.v1 import verify_pb2 as pb

SESSION = "/sled.v1.Verifier/Session"
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# grpc.aio's own status for a write on a stream the server has already ended (grpc/grpc#36066): the client's, not
# the server's (edge_client.transport.CORE_WRITE_FAILED)
CORE_WRITE_FAILED = "Internal error from Core"


@dataclass(frozen=True)
class Server:
    """What the fuzzer needs to know of the server it fuzzes (from its GetInfo)."""

    address: str
    fingerprint: str
    vocab_size: int
    context_limit: int
    max_draft_tokens: int
    max_sessions: int


async def server_facts(address: str) -> Server:
    from sled.v1 import verify_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        info = await pb_grpc.VerifierStub(channel).GetInfo(pb.InfoRequest(), timeout=30, wait_for_ready=True)
    return Server(address, info.tokenizer_fingerprint, info.vocab_size, info.context_limit, info.max_draft_tokens,
                  info.max_sessions)


# ---- what a stream sends: each action is (kind, payload) ----

def _ids(vocab: int, max_size: int, bad: bool = False):
    top = vocab + 1000 if bad else vocab - 1
    return st.lists(st.integers(0, top), max_size=max_size)


def opens(server: Server):
    vocab = server.vocab_size
    sampling = st.builds(
        dict,
        temperature=st.sampled_from([0.0, 0.0, 0.7, 1.0, 1e-40, -1.0, float("nan"), float("inf")]),
        top_k=st.sampled_from([0, 0, 5, 2**31]),
        top_p=st.sampled_from([1.0, 0.9, 0.0, 1.5, float("nan")]),
    )
    return st.builds(
        dict,
        fingerprint=st.sampled_from([server.fingerprint] * 6 + ["", "sha256:nope"]),
        context=st.one_of(_ids(vocab, 48).filter(bool), _ids(vocab, 8, bad=True),
                          st.just([1] * server.context_limit)),
        max_tokens=st.sampled_from([1, 4, 16, 64, 0]),
        sampling=sampling,
        seed=st.none() | st.integers(0, 2**64 - 1),
        stops=st.sampled_from([[], [7], [vocab + 5], list(range(300))]),
        server_decodes=st.booleans(),
    ).map(lambda o: ("open", o))


def drafts(server: Server):
    k = server.max_draft_tokens
    return st.builds(
        dict,
        session=st.sampled_from(["own", "own", "own", "other", ""]),
        round=st.integers(0, 2**32 - 1),
        tokens=st.one_of(_ids(server.vocab_size, k), _ids(server.vocab_size, k + 3, bad=True)),
        probs=st.sampled_from(["none", "none", "exact", "nan", "unnormalized", "bad_offsets"]),
    ).map(lambda d: ("draft", d))


def actions(server: Server):
    """A stream's actions, each with whether its reply is read before the next (a cancel or a message may then
    land while the server is still working on the one before: an Open in flight, a Draft being verified)."""
    other = st.sampled_from([("close", None), ("empty", None), ("done_writing", None), ("cancel", None),
                             ("cancel", None)])
    garbage = st.binary(min_size=1, max_size=64).map(lambda b: ("bytes", b))
    action = st.tuples(st.one_of(opens(server), drafts(server), drafts(server), other, garbage), st.booleans())
    return st.lists(action.map(lambda a: (*a[0], a[1])), min_size=1, max_size=8)


def streams(server: Server):
    return st.lists(actions(server), min_size=1, max_size=4)


# ---- running them ----

def _open_message(o: dict) -> bytes:
    sp = pb.SamplingParams(**o["sampling"])
    if o["seed"] is not None:
        sp.seed = o["seed"]
    return pb.ClientMessage(open=pb.Open(
        tokenizer_fingerprint=o["fingerprint"], context_token_ids=o["context"], sampling=sp,
        max_tokens=o["max_tokens"], stop_token_ids=o["stops"], client_id="fuzz",
        server_decodes=o["server_decodes"])).SerializeToString()


def _draft_message(d: dict, session_id: str) -> bytes:
    sid = {"own": session_id, "other": "0" * 32, "": ""}[d["session"]]
    draft = pb.Draft(session_id=sid, round=d["round"], token_ids=d["tokens"])
    n = len(d["tokens"])
    if d["probs"] != "none" and n:
        offsets = list(range(n + 1))
        probs = [1.0] * n
        if d["probs"] == "nan":
            probs[0] = float("nan")
        elif d["probs"] == "unnormalized":
            probs[-1] = 0.5
        elif d["probs"] == "bad_offsets":
            offsets = offsets[:-1]
        draft.draft_probs.offsets.extend(offsets)
        draft.draft_probs.token_ids.extend(d["tokens"])
        draft.draft_probs.probs.extend(probs)
    return pb.ClientMessage(draft=draft).SerializeToString()


async def _read(call, timeout: float):
    """The next reply, None at the stream's end or on a short timeout (the server owes no reply)."""
    try:
        reply = await asyncio.wait_for(call.read(), timeout)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return None
    return None if reply is grpc.aio.EOF else reply


async def run_stream(channel, plan: list, call_timeout: float) -> grpc.StatusCode:
    """Send one stream's actions; returns the code the call ended with."""
    call = channel.stream_stream(SESSION, request_serializer=lambda b: b,
                                 response_deserializer=pb.ServerMessage.FromString)()
    session_id = ""
    ended = False
    try:
        for kind, payload, wait in plan:
            if call.done():
                break
            if kind == "cancel":
                call.cancel()
                ended = True
                break
            if kind == "done_writing":
                await call.done_writing()
                break
            data = {"open": lambda: _open_message(payload), "draft": lambda: _draft_message(payload, session_id),
                    "close": lambda: pb.ClientMessage(close=pb.Close()).SerializeToString(),
                    "empty": lambda: b"", "bytes": lambda: payload}[kind]()
            try:
                await call.write(data)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break
            if wait:
                reply = await _read(call, 2.0)
                if reply is not None and reply.WhichOneof("kind") == "opened":
                    session_id = reply.opened.session_id
        if not ended and not call.done():
            try:
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
            # the server must end the stream by itself now: a session it decodes finishes, any other ends
            deadline = time.monotonic() + call_timeout
            while await _read(call, max(0.01, deadline - time.monotonic())) is not None:
                pass
        code = await asyncio.wait_for(call.code(), call_timeout)
        if code == grpc.StatusCode.INTERNAL and await call.details() == CORE_WRITE_FAILED:
            return grpc.StatusCode.OK  # the server had ended the stream; the client wrote on
        return code
    except asyncio.TimeoutError:
        call.cancel()
        raise AssertionError(f"a stream did not end within {call_timeout:g}s: {plan!r}") from None


async def free_slots(server: Server, within_s: float) -> tuple[int, int]:
    """(active sessions, free slots) once every session is freed, or as they stand after `within_s`."""
    from sled.v1 import verify_pb2_grpc as pb_grpc

    deadline = time.monotonic() + within_s
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        while True:
            stats = (await stub.GetInfo(pb.InfoRequest(), timeout=10)).stats
            if (stats.active_sessions == 0 and stats.free_slots == server.max_sessions) or time.monotonic() > deadline:
                return stats.active_sessions, stats.free_slots
            await asyncio.sleep(0.05)


async def run_example(server: Server, plans: list[list], call_timeout: float) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        codes = await asyncio.gather(*(run_stream(channel, plan, call_timeout) for plan in plans))
    bad = [(code, plan) for code, plan in zip(codes, plans) if code in BAD_CODES]
    assert not bad, f"calls ended {bad[0][0].name}: {bad[0][1]!r}"
    active, free = await free_slots(server, within_s=10.0)
    assert active == 0 and free == server.max_sessions, (
        f"{active} sessions still open, {free} of {server.max_sessions} slots free after {plans!r}")


def fuzz(server: Server, examples: int, call_timeout: float = 30.0, seed: int | None = None) -> int:
    """Run `examples` random examples against `server`; raises AssertionError with the smallest failing one."""
    count = [0]

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(streams(server))
    def check(plans):
        count[0] += 1
        asyncio.run(run_example(server, plans, call_timeout))

    (hypothesis.seed(seed)(check) if seed is not None else check)()
    return count[0]


def build_parser() -> argparse.ArgumentParser:
    from bench.cli import positive

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", metavar="HOST:PORT",
                   help="fuzz this running server (default: start a server of the tiny random target)")
    p.add_argument("--examples", type=positive(int), default=500, help="examples to run (default 500)")
    p.add_argument("--call-timeout", type=positive(), default=30.0, metavar="S",
                   help="longest a stream may take to end once its actions are sent (default 30)")
    p.add_argument("--seed", type=int, help="run the same examples every time")
    return p


def main(args) -> int:
    from sim.processes import ServerProcess

    proc = None
    address = args.server
    if address is None:
        # Steps of at least 5 ms, as a loaded server's: messages and cancels then land while a step runs (an Open
        # waiting in the engine's inbox when its stream is cancelled), which an idle tiny target answers too fast for.
        proc = ServerProcess("--target", "random:llama-tiny", "--max-sessions", "8", "--max-seq-len", "256",
                             "--idle-timeout-s", "20", "--seed", "0", "--min-step-ms", "5")
        address = proc.start()
    try:
        server = asyncio.run(server_facts(address))
        print(f"[fuzz] {args.examples} examples against {address} ({server.max_sessions} slots)", flush=True)
        t0 = time.monotonic()
        ran = fuzz(server, args.examples, args.call_timeout, args.seed)
        print(f"[fuzz] {ran} examples passed in {time.monotonic() - t0:.0f}s: no INTERNAL or UNKNOWN, every "
              "stream ended, every slot free after each", flush=True)
    finally:
        if proc is not None:
            proc.stop()
    return 0
