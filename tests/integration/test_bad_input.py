"""Every bad input gets a clear gRPC status and leaves every other session untouched."""

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc
from tests.conftest import PROMPTS, run

pytestmark = pytest.mark.model


class Stream:
    """A raw session stream, to send exactly the messages a test wants."""

    def __init__(self, channel):
        self.call = pb_grpc.VerifierStub(channel).Session()

    async def send(self, **kind) -> pb.ServerMessage:
        await self.call.write(pb.ClientMessage(**kind))
        return await self.call.read()


def open_msg(target, ids, fingerprint=None, max_tokens=32, **kw):
    return pb.Open(tokenizer_fingerprint=target.fingerprint if fingerprint is None else fingerprint,
                   context_token_ids=ids, max_tokens=max_tokens, sampling=pb.SamplingParams(**kw))


async def expect_refusal(coro, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() == code, err.value.details()
    return err.value.details()


async def with_bystander(server, target, reference, tokenizer, bad):
    """Run a greedy server-only session, do `bad` halfway, then check the session ends exactly as the reference."""
    prompt = tokenizer.encode(PROMPTS[0])
    want = reference(tuple(prompt), 12)
    async with grpc.aio.insecure_channel(server.address) as channel:
        s = Stream(channel)
        sid = (await s.send(open=open_msg(target, prompt, max_tokens=12))).opened.session_id
        got = []
        for round_ in range(12):
            if round_ == 3:
                async with grpc.aio.insecure_channel(server.address) as other:
                    detail = await bad(other)
            v = (await s.send(draft=pb.Draft(session_id=sid, round=round_))).verdict
            got.append(v.next_token)
            if v.finished:
                break
        await s.send(close=pb.Close())
    assert got == want
    return detail


def test_token_id_out_of_range(make_server, target, reference_greedy, tokenizer):
    server = make_server()

    async def bad(channel):
        s = Stream(channel)
        detail = await expect_refusal(s.send(open=open_msg(target, [1, 2, 60000])), grpc.StatusCode.INVALID_ARGUMENT)
        s = Stream(channel)
        sid = (await s.send(open=open_msg(target, [1, 2, 3]))).opened.session_id
        detail2 = await expect_refusal(s.send(draft=pb.Draft(session_id=sid, token_ids=[5, 49152])),
                                       grpc.StatusCode.INVALID_ARGUMENT)
        return detail, detail2

    d1, d2 = run(with_bystander(server, target, reference_greedy, tokenizer, bad))
    assert "60000" in d1 and "49152" in d1
    assert "49152" in d2 and "out of range" in d2


def test_draft_longer_than_maximum(make_server, target, reference_greedy, tokenizer):
    server = make_server(max_draft_tokens=4)

    async def bad(channel):
        s = Stream(channel)
        sid = (await s.send(open=open_msg(target, [1, 2, 3]))).opened.session_id
        return await expect_refusal(s.send(draft=pb.Draft(session_id=sid, token_ids=[5] * 5)),
                                    grpc.StatusCode.INVALID_ARGUMENT)

    assert "max_draft_tokens=4" in run(with_bystander(server, target, reference_greedy, tokenizer, bad))


@pytest.mark.parametrize("probs,needle", [
    ([math.nan, 1.0], "finite"),
    ([math.inf, 0.0], "finite"),
    ([-0.5, 1.5], "[0, 1]"),
    ([0.3, 0.3], "sum to 1"),
])
def test_bad_draft_probabilities(make_server, target, reference_greedy, tokenizer, probs, needle):
    server = make_server()

    async def bad(channel):
        s = Stream(channel)
        sid = (await s.send(open=open_msg(target, [1, 2, 3], temperature=1.0))).opened.session_id
        q = pb.SparseDistributions(offsets=[0, 2], token_ids=[5, 6], probs=probs)
        return await expect_refusal(s.send(draft=pb.Draft(session_id=sid, token_ids=[5], draft_probs=q)),
                                    grpc.StatusCode.INVALID_ARGUMENT)

    assert needle in run(with_bystander(server, target, reference_greedy, tokenizer, bad))


def test_unknown_session_and_draft_before_open(make_server, target, reference_greedy, tokenizer):
    server = make_server()

    async def bad(channel):
        s = Stream(channel)
        before = await expect_refusal(s.send(draft=pb.Draft(session_id="x", token_ids=[5])),
                                      grpc.StatusCode.FAILED_PRECONDITION)
        s = Stream(channel)
        await s.send(open=open_msg(target, [1, 2, 3]))
        unknown = await expect_refusal(s.send(draft=pb.Draft(session_id="no-such-session", token_ids=[5])),
                                       grpc.StatusCode.NOT_FOUND)
        return before, unknown

    before, unknown = run(with_bystander(server, target, reference_greedy, tokenizer, bad))
    assert "Open" in before
    assert "no-such-session" in unknown


def test_tokenizer_mismatch_names_both_sides(make_server, target, reference_greedy, tokenizer):
    server = make_server()

    async def bad(channel):
        return await expect_refusal(Stream(channel).send(open=open_msg(target, [1, 2], fingerprint="sha256:abc")),
                                    grpc.StatusCode.FAILED_PRECONDITION)

    detail = run(with_bystander(server, target, reference_greedy, tokenizer, bad))
    assert "sha256:abc" in detail and target.fingerprint in detail and "mismatch" in detail


def test_prompt_over_context_limit(make_server, target, reference_greedy, tokenizer):
    server = make_server(max_seq_len=64)

    async def bad(channel):
        return await expect_refusal(Stream(channel).send(open=open_msg(target, [5] * 64)),
                                    grpc.StatusCode.INVALID_ARGUMENT)

    detail = run(with_bystander(server, target, reference_greedy, tokenizer, bad))
    assert "64 tokens" in detail and "context limit" in detail


def test_full_pool_refuses_with_resource_exhausted(make_server, target, reference_greedy, tokenizer):
    server = make_server(max_sessions=2)

    async def bad(channel):
        s = Stream(channel)
        await s.send(open=open_msg(target, [1, 2]))
        return await expect_refusal(Stream(channel).send(open=open_msg(target, [1, 2])),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED)

    assert "all 2 sessions are in use" in run(with_bystander(server, target, reference_greedy, tokenizer, bad))


def test_an_open_past_the_kv_pool_is_refused_naming_the_pool(make_server, target, reference_greedy, tokenizer):
    server = make_server(max_sessions=4, max_seq_len=512, kv_cache_tokens=512)  # 32 blocks of 16 tokens

    async def bad(channel):
        s = Stream(channel)
        await s.send(open=open_msg(target, list(range(1, 301))))  # 19 blocks
        # another prompt: none of the first one's blocks (published once prefilled) can be shared
        return await expect_refusal(Stream(channel).send(open=open_msg(target, list(range(2, 302)))),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED)

    detail = run(with_bystander(server, target, reference_greedy, tokenizer, bad))
    assert "KV pool exhausted" in detail and "32 blocks of 16 tokens (512 tokens)" in detail


def test_wrong_auth_token_is_unauthenticated(make_server, target):
    server = make_server(auth_token="secret")

    async def go():
        async with grpc.aio.insecure_channel(server.address) as channel:
            msg = open_msg(target, [1, 2])
            msg.auth_token = "wrong"
            await expect_refusal(Stream(channel).send(open=msg), grpc.StatusCode.UNAUTHENTICATED)
            msg.auth_token = "secret"
            assert (await Stream(channel).send(open=msg)).opened.session_id

    run(go())


def test_vanished_client_frees_its_kv(make_server, target):
    server = make_server(max_sessions=4)

    async def go():
        channel = grpc.aio.insecure_channel(server.address)
        s = Stream(channel)
        sid = (await s.send(open=open_msg(target, list(range(1, 40))))).opened.session_id
        await s.send(draft=pb.Draft(session_id=sid, token_ids=[5, 6]))
        assert server.engine.free_sessions() == 3
        await channel.close(grace=None)  # the device disappears without Close
        for _ in range(100):
            if server.engine.free_sessions() == 4:
                break
            await asyncio.sleep(0.05)
        assert server.engine.free_sessions() == 4
        assert server.engine.stats()["active_sessions"] == 0

    run(go())


def test_idle_session_is_freed_and_then_unknown(make_server, target):
    server = make_server(max_sessions=2, idle_timeout_s=0.3)

    async def go():
        async with grpc.aio.insecure_channel(server.address) as channel:
            s = Stream(channel)
            sid = (await s.send(open=open_msg(target, [1, 2, 3]))).opened.session_id
            for _ in range(60):
                if server.engine.free_sessions() == 2:
                    break
                await asyncio.sleep(0.1)
            assert server.engine.free_sessions() == 2
            detail = await expect_refusal(s.send(draft=pb.Draft(session_id=sid)), grpc.StatusCode.NOT_FOUND)
            assert "expired" in detail

    run(go())


def test_health_is_not_serving_until_warm(make_server, capsys):
    from edge_client.cli import main as edge_main

    server = make_server(load=False)

    async def status():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return (await stub.Check(health_pb2.HealthCheckRequest(service="sled.v1.Verifier"))).status

    async def early_session():
        async with grpc.aio.insecure_channel(server.address) as channel:
            await expect_refusal(pb_grpc.VerifierStub(channel).GetInfo(pb.InfoRequest()), grpc.StatusCode.UNAVAILABLE)

    assert run(status()) == health_pb2.HealthCheckResponse.NOT_SERVING
    run(early_session())
    assert edge_main(["info", "--server", server.address]) == 1  # the CLI says what the server answered
    assert f"sled-edge info: {server.address} answered UNAVAILABLE:" in capsys.readouterr().err
    server.load()
    assert run(status()) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(make_server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    server = make_server()
    with grpc.insecure_channel(server.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"sled.v1.Verifier", "grpc.health.v1.Health"} <= services
