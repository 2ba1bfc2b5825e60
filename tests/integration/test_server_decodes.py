"""Open.server_decodes: the server decodes every token of a session itself and streams a Verdict per token, the
server-only way of serving (no round trip between tokens); the device's `none` drafter asks for it."""

from edge_client.policy import DraftPolicy
import asyncio
import dataclasses

import grpc
import pytest

from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc
from tests.conftest import all_freed, run

pytestmark = pytest.mark.model


def open_msg(tiny, ids, max_tokens, server_decodes):
    return pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=tiny.fingerprint, context_token_ids=ids,
                                         max_tokens=max_tokens, server_decodes=server_decodes))


async def drafted_greedy(channel, tiny, ids, max_tokens) -> list[int]:
    """The same server's greedy text, asked a token at a time with empty drafts (the way before server_decodes)."""
    call = pb_grpc.VerifierStub(channel).Session()
    await call.write(open_msg(tiny, ids, max_tokens, False))
    opened = (await call.read()).opened
    assert not opened.server_decodes
    out = []
    for round_ in range(max_tokens):
        await call.write(pb.ClientMessage(draft=pb.Draft(session_id=opened.session_id, round=round_)))
        v = (await call.read()).verdict
        out.append(v.next_token)
        if v.finished:
            break
    call.cancel()
    return out


def test_the_server_streams_every_token_unasked_and_they_are_its_greedy_text(tiny_server, tiny):
    ids = [1, 504, 3458, 314, 1345, 30]

    async def go():
        async with grpc.aio.insecure_channel(tiny_server.address) as channel:
            want = await drafted_greedy(channel, tiny, ids, 12)
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg(tiny, ids, 12, True))
            opened = (await call.read()).opened
            verdicts = [(await call.read()).verdict for _ in range(12)]  # nothing written in between
            await call.write(pb.ClientMessage(close=pb.Close()))
            await call.done_writing()
            closed = (await call.read()).closed
            end = await call.read()
            return want, opened, verdicts, closed, end, await call.code()

    want, opened, verdicts, closed, end, code = run(go())
    assert opened.server_decodes
    assert [v.round for v in verdicts] == list(range(12))
    assert all(v.n_accepted == 0 and v.HasField("next_token") for v in verdicts)
    assert [v.finished for v in verdicts] == [False] * 11 + [True]
    assert verdicts[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [v.next_token for v in verdicts] == want
    assert closed.generated_tokens == 12 and end is grpc.aio.EOF and code == grpc.StatusCode.OK
    assert all_freed(tiny_server)


def test_a_close_stops_the_server_decoding_early(tiny_server, tiny):
    async def go():
        async with grpc.aio.insecure_channel(tiny_server.address) as channel:
            before = tiny_server.engine.stats()["emitted_tokens"]
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg(tiny, [1, 2, 3, 4], 200, True))
            assert (await call.read()).opened.server_decodes
            first = [(await call.read()).verdict for _ in range(3)]
            await call.write(pb.ClientMessage(close=pb.Close()))
            await call.done_writing()
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            return before, first, rest, await call.code()

    before, first, rest, code = run(go())
    assert not any(v.finished for v in first)
    # the tokens decoded before the Close was read (a step takes about a millisecond here), then Closed and the end
    # of the stream; a server that read the Close only after the whole generation would have sent all 200 first
    kinds = [m.WhichOneof("kind") for m in rest]
    assert kinds[-1] == "closed" and set(kinds[:-1]) <= {"verdict"} and len(rest) < 100
    assert not any(m.verdict.finished for m in rest[:-1])
    assert code == grpc.StatusCode.OK
    assert tiny_server.engine.stats()["emitted_tokens"] - before < 100  # not the 200 asked
    assert all_freed(tiny_server)


def test_a_draft_to_a_session_the_server_decodes_is_refused_and_others_go_on(tiny_server, tiny):
    ids = [1, 504, 3458, 314]

    async def go():
        async with grpc.aio.insecure_channel(tiny_server.address) as channel:
            want = await drafted_greedy(channel, tiny, ids, 10)
            bystander = pb_grpc.VerifierStub(channel).Session()
            await bystander.write(open_msg(tiny, ids, 10, True))
            await bystander.read()
            got = [(await bystander.read()).verdict.next_token for _ in range(3)]
            bad = pb_grpc.VerifierStub(channel).Session()
            await bad.write(open_msg(tiny, [1, 2, 3], 50, True))
            sid = (await bad.read()).opened.session_id
            await bad.write(pb.ClientMessage(draft=pb.Draft(session_id=sid, round=0, token_ids=[5])))
            with pytest.raises(grpc.aio.AioRpcError):
                while True:  # the verdicts sent before the Draft was read, then the refusal
                    await bad.read()
            got += [(await bystander.read()).verdict.next_token for _ in range(7)]
            bystander.cancel()
            return want, got, await bad.code(), await bad.details()

    want, got, code, details = run(go())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "decoded by the server" in details and "send no Draft" in details
    assert got == want


def test_generate_without_a_drafter_reads_the_server_s_stream(tiny_server, tiny, tokenizer):
    from edge_client.drafters import create_drafter
    from edge_client.generation import generate
    from edge_client.request import Request
    from edge_client.transport import RemoteSession, VerifierClient

    ids = tokenizer.encode("The capital of France is")
    opened = []
    real_open = RemoteSession.open

    async def spy(self, msg, timeout):
        result = await real_open(self, msg, timeout)
        opened.append((msg.open.server_decodes, result.server_decodes))
        return result

    async def go():
        client = VerifierClient(tiny_server.address)
        try:
            async with grpc.aio.insecure_channel(tiny_server.address) as channel:
                want = await drafted_greedy(channel, tiny, ids, 16)
            # the `none` drafter whatever draft_tokens says, and draft_tokens=0 with any drafter
            a = await generate(
                client,
                create_drafter("none"),
                tokenizer,
                Request(ids, max_tokens=16, policy=DraftPolicy(draft_tokens=4)),
            )
            b = await generate(
                client,
                create_drafter("ngram"),
                tokenizer,
                Request(ids, max_tokens=16, policy=DraftPolicy(draft_tokens=0)),
            )
            return want, a, b
        finally:
            await client.close()

    RemoteSession.open = spy
    try:
        want, a, b = run(go())
    finally:
        RemoteSession.open = real_open
    assert opened == [(True, True), (True, True)]
    for result in (a, b):
        assert result.token_ids == want
        assert result.rounds == 16 and result.draft_tokens == 0 and result.finish_reason == "length"
    assert tiny_server.engine.stats()["drafts"] == 0  # no verification carried a draft token
    assert all_freed(tiny_server)


def test_a_server_without_server_decodes_gets_empty_drafts(tiny_server, tiny, tokenizer, monkeypatch):
    """A server older than Open.server_decodes ignores it and says nothing of it in Opened: the device then asks each
    token with an empty draft, as before, and gets the same text."""
    import verify_server.codec as server_codec
    from edge_client.drafters import create_drafter
    from edge_client.generation import generate
    from edge_client.request import Request
    from edge_client.transport import VerifierClient

    real = server_codec.open_from_pb
    monkeypatch.setattr(server_codec, "open_from_pb",
                        lambda *args: dataclasses.replace(real(*args), server_decodes=False))
    ids = tokenizer.encode("The capital of France is")

    async def go():
        client = VerifierClient(tiny_server.address)
        try:
            async with grpc.aio.insecure_channel(tiny_server.address) as channel:
                want = await drafted_greedy(channel, tiny, ids, 10)
            verifications = tiny_server.engine.stats()["verifications"]
            got = await asyncio.wait_for(
                generate(client, create_drafter("none"), tokenizer, Request(ids, max_tokens=10)), 60
            )
            return want, got, tiny_server.engine.stats()["verifications"] - verifications
        finally:
            await client.close()

    want, got, asked = run(go())
    assert got.token_ids == want and got.rounds == 10
    assert asked == 10  # one empty draft a token
