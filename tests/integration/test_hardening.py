"""A careless or hostile client against a real server: no slot leaks, fair steps, per-device identity and quotas,
strict and cheap edges. Each case leaves every other session untouched."""

import asyncio
import gc
import logging
import threading
import time

import grpc
import pytest

from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc
from sled.v1.limits import max_message_bytes
from tests.conftest import all_freed, run
from verify_server.auth import token_hash

pytestmark = pytest.mark.model


def open_msg(target, ids=(1, 2, 3), max_tokens=8, token="", **sampling):
    return pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=target.fingerprint, context_token_ids=list(ids),
                                         max_tokens=max_tokens, auth_token=token,
                                         sampling=pb.SamplingParams(**sampling)))


def wait_until(check, within_s=10.0):
    deadline = time.monotonic() + within_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def gate_opens(server):
    """Hold the engine worker inside every Open until `release` is set; `entered` is set once one is held."""
    engine = server.engine
    entered, release = threading.Event(), threading.Event()
    real = engine._open

    def held(request, on_verdict=None):
        entered.set()
        assert release.wait(30)
        return real(request, on_verdict)

    engine._open = held
    return entered, release


def test_an_open_cancelled_while_the_engine_holds_it_leaves_no_session(make_tiny_server, tiny):
    server = make_tiny_server()
    entered, release = gate_opens(server)

    async def cancel_after_open():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg(tiny))
            assert await asyncio.to_thread(entered.wait, 10)
            call.cancel()
        # the handler is gone before the engine answers: the session it asked for belongs to nobody
        assert await asyncio.to_thread(wait_until, lambda: server.server.servicer.streams == 0)

    run(cancel_after_open())
    release.set()
    assert wait_until(lambda: server.engine.stats()["sessions_opened"] == 1)
    assert all_freed(server)
    assert server.engine.free_sessions() == server.server.config.max_sessions


def test_an_open_that_times_out_at_the_device_leaves_no_session(make_tiny_server, tiny):
    from edge_client.transport import VerifierClient, VerifyError

    server = make_tiny_server()
    entered, release = gate_opens(server)

    async def open_with_short_timeout():
        client = VerifierClient(server.address)
        try:
            with pytest.raises(VerifyError) as err:
                await client.open(open_msg(tiny), timeout=0.3)
            assert err.value.code == "DEADLINE_EXCEEDED"
        finally:
            await client.close()

    run(open_with_short_timeout())
    assert entered.is_set()
    assert wait_until(lambda: server.server.servicer.streams == 0)
    release.set()
    assert wait_until(lambda: server.engine.stats()["sessions_opened"] == 1)
    assert all_freed(server)


def test_a_long_prompt_is_prefilled_in_chunks_beside_a_decoding_session(make_tiny_server, tiny):
    server = make_tiny_server(max_seq_len=1024, prefill_chunk_tokens=16, max_batch_tokens=512)

    async def both():
        async with grpc.aio.insecure_channel(server.address) as channel:
            light = pb_grpc.VerifierStub(channel).Session()
            await light.write(open_msg(tiny, max_tokens=200))
            sid = (await light.read()).opened.session_id
            heavy = pb_grpc.VerifierStub(channel).Session()
            await heavy.write(open_msg(tiny, ids=[(7 * i) % 4000 + 1 for i in range(900)], max_tokens=2))
            hid = (await heavy.read()).opened.session_id
            heavy_verdict = asyncio.ensure_future(heavy.write(pb.ClientMessage(draft=pb.Draft(session_id=hid))))
            steps = []
            for round_ in range(120):
                await light.write(pb.ClientMessage(draft=pb.Draft(session_id=sid, round=round_)))
                steps.append((await light.read()).verdict.step_tokens)
            await heavy_verdict
            first = (await heavy.read()).verdict
            for call in (light, heavy):
                call.cancel()
            return steps, first

    steps, first = run(both())
    # every step that verified the light session carried at most a chunk of the prompt: its own token, the heavy
    # session's once prefilled, and 16 prompt tokens
    assert max(steps) <= 16 + 2
    assert first.round == 0 and first.HasField("next_token")
    assert all_freed(server)


def test_an_idle_session_does_not_shrink_a_long_prompts_chunks(make_tiny_server, tiny):
    """A session that was prefilled and then sends nothing is idle past IDLE_AFTER_S: a prompt beside it is prefilled
    in whole-budget steps, not in the 16-token chunks a session in rounds gets (the test above)."""
    from verify_server.scheduler import IDLE_AFTER_S

    server = make_tiny_server(max_seq_len=1024, prefill_chunk_tokens=16, max_batch_tokens=512)

    async def prompt_beside_idle():
        async with grpc.aio.insecure_channel(server.address) as channel:
            idle = pb_grpc.VerifierStub(channel).Session()
            await idle.write(open_msg(tiny, max_tokens=200))
            await idle.read()
            await asyncio.sleep(IDLE_AFTER_S + 0.5)  # prefilled at once, then silent
            before = server.engine.stats()["steps"]
            heavy = pb_grpc.VerifierStub(channel).Session()
            await heavy.write(open_msg(tiny, ids=[(7 * i) % 4000 + 1 for i in range(900)], max_tokens=2))
            hid = (await heavy.read()).opened.session_id
            await heavy.write(pb.ClientMessage(draft=pb.Draft(session_id=hid)))
            first = (await heavy.read()).verdict
            steps = server.engine.stats()["steps"] - before
            for call in (idle, heavy):
                call.cancel()
            return first, steps

    first, steps = run(prompt_beside_idle())
    assert first.round == 0 and first.HasField("next_token")
    # 512 + 387 prompt tokens, then the verdict (its step may be counted just after the reply); in 16-token chunks
    # it would take 58
    assert steps <= 3
    assert all_freed(server)


def test_device_tokens_name_devices_in_logs_and_metrics_and_quotas_are_per_device(make_tiny_server, tiny, tmp_path,
                                                                                   caplog):
    tokens = tmp_path / "devices.tokens"
    tokens.write_text(f"orin-1:{token_hash('tok-a')}\npi-2:{token_hash('tok-b')}\n")
    server = make_tiny_server(auth_tokens_file=str(tokens), max_sessions_per_device=2)
    caplog.set_level(logging.INFO, logger="verify_server")

    async def fleet():
        async with grpc.aio.insecure_channel(server.address) as channel:
            calls = []
            for _ in range(2):
                call = pb_grpc.VerifierStub(channel).Session()
                await call.write(open_msg(tiny, token="tok-a"))
                calls.append((call, (await call.read()).opened.session_id))
            third = pb_grpc.VerifierStub(channel).Session()
            await third.write(open_msg(tiny, token="tok-a"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await third.read()
            other = pb_grpc.VerifierStub(channel).Session()
            await other.write(open_msg(tiny, token="tok-b"))
            assert (await other.read()).opened.session_id  # another device is not held back
            # orin-1 revoked: refused at its next Open; its open sessions go on
            tokens.write_text(f"pi-2:{token_hash('tok-b')}\n")
            server.server.reload_credentials()
            again = pb_grpc.VerifierStub(channel).Session()
            await again.write(open_msg(tiny, token="tok-a"))
            with pytest.raises(grpc.aio.AioRpcError) as revoked:
                await again.read()
            call, sid = calls[0]
            await call.write(pb.ClientMessage(draft=pb.Draft(session_id=sid)))
            assert (await call.read()).verdict.HasField("next_token")
            for call, _ in calls + [(other, None)]:
                call.cancel()
            return refused.value, revoked.value

    refused, revoked = run(fleet())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "orin-1" in refused.details() and "max_sessions_per_device" in refused.details()
    assert revoked.code() == grpc.StatusCode.UNAUTHENTICATED
    registry = server.engine.metrics.registry
    assert registry.get_sample_value("sled_device_sessions_total", {"device": "orin-1"}) == 2
    assert registry.get_sample_value("sled_device_sessions_total", {"device": "pi-2"}) == 1
    assert registry.get_sample_value("sled_sessions_refused_total",
                                     {"device": "orin-1", "reason": "max_sessions_per_device"}) == 1
    assert registry.get_sample_value("sled_auth_failures_total") == 1
    text = caplog.text
    assert "opened for orin-1" in text and "opened for pi-2" in text
    assert "refused an Open from 127.0.0.1" in text
    assert all_freed(server)


def test_an_empty_draft_every_few_seconds_cannot_hold_every_slot(make_tiny_server, tiny):
    server = make_tiny_server(max_sessions=4, max_sessions_per_device=2)

    async def hog():
        async with grpc.aio.insecure_channel(server.address) as channel:
            held = []
            for _ in range(3):
                call = pb_grpc.VerifierStub(channel).Session()
                await call.write(open_msg(tiny))
                held.append(call)
            opened = []
            for call in held:
                try:
                    opened.append((await call.read()).WhichOneof("kind"))
                except grpc.aio.AioRpcError as err:
                    opened.append(err.code())
            free = server.engine.free_sessions()
            for call in held:
                call.cancel()
            return opened, free

    opened, free = run(hog())
    assert opened == ["opened", "opened", grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert free == 2  # the slots another device needs stay free
    assert all_freed(server)


def test_a_message_past_what_the_settings_allow_is_refused_before_it_is_decoded(make_tiny_server, tiny):
    server = make_tiny_server(max_seq_len=256)

    async def oversized():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            # past the receive limit (the context's ids, the stop ids and the largest constraint an Open may carry)
            await call.write(open_msg(tiny, ids=[1] * (max_message_bytes(256, 16, 64) + 1)))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            ok = pb_grpc.VerifierStub(channel).Session()
            await ok.write(open_msg(tiny, ids=[1] * 255))  # the largest context the settings allow still fits
            kind = (await ok.read()).WhichOneof("kind")
            ok.cancel()
            return err.value, kind

    err, kind = run(oversized())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert kind == "opened"
    assert all_freed(server)


def test_undecodable_bytes_get_invalid_argument_and_one_log_line(make_tiny_server, caplog):
    server = make_tiny_server()
    caplog.set_level(logging.INFO)
    garbage = b"\x12\xff\xff\xff\xff\x0f"  # field 2 (draft), length-delimited, a length past the end

    async def send():
        async with grpc.aio.insecure_channel(server.address) as channel:
            session = channel.stream_stream("/sled.v1.Verifier/Session", request_serializer=lambda b: b,
                                            response_deserializer=pb.ServerMessage.FromString)()
            await session.write(garbage)
            with pytest.raises(grpc.aio.AioRpcError) as stream_err:
                await session.read()
            info = channel.unary_unary("/sled.v1.Verifier/GetInfo", request_serializer=lambda b: b,
                                       response_deserializer=pb.ServerInfo.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as unary_err:
                await info(garbage)
            return stream_err.value, unary_err.value

    stream_err, unary_err = run(send())
    for err in (stream_err, unary_err):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "not a valid" in err.details()
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.WARNING and r.exc_info is None for r in lines)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_tiny_positive_temperature_is_greedy_not_nan(make_tiny_server, tiny):
    server = make_tiny_server()

    async def decode(temperature):
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg(tiny, ids=[5, 6, 7, 8], max_tokens=12, temperature=temperature))
            sid = (await call.read()).opened.session_id
            tokens = []
            for round_ in range(12):
                await call.write(pb.ClientMessage(draft=pb.Draft(session_id=sid, round=round_)))
                v = (await call.read()).verdict
                tokens.append(v.next_token)
                if v.finished:
                    break
            call.cancel()
            return tokens

    greedy = run(decode(0.0))
    assert run(decode(1e-40)) == greedy
    assert run(decode(1e-38)) == greedy
    assert len(set(greedy)) > 1 or greedy[0] != 0


def test_a_stream_that_never_sends_open_is_ended(make_tiny_server):
    server = make_tiny_server(idle_timeout_s=0.5)

    async def silent():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            return err.value

    err = run(silent())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle_timeout_s" in err.details()
    assert wait_until(lambda: server.server.servicer.streams == 0)


def test_cancelling_a_server_decoded_stream_leaves_no_unretrieved_task_error(make_tiny_server, tiny):
    server = make_tiny_server(max_seq_len=256)
    errors = []
    server.loop.call_soon_threadsafe(server.loop.set_exception_handler, lambda loop, ctx: errors.append(ctx))

    async def cancel_midway():
        async with grpc.aio.insecure_channel(server.address) as channel:
            for _ in range(3):
                call = pb_grpc.VerifierStub(channel).Session()
                msg = open_msg(tiny, max_tokens=200)
                msg.open.server_decodes = True
                await call.write(msg)
                await call.read()
                for _ in range(3):
                    await call.read()
                call.cancel()

    run(cancel_midway())
    assert wait_until(lambda: server.server.servicer.streams == 0)
    server.call(asyncio.sleep(0.1))
    server.call(asyncio.to_thread(gc.collect))
    gc.collect()
    server.call(asyncio.sleep(0.1))
    assert not [e for e in errors if "never retrieved" in e.get("message", "")], errors
    assert all_freed(server)


def test_sighup_rereads_the_device_tokens_of_a_running_server(tiny, tmp_path):
    import signal

    from sim.processes import ServerProcess

    tokens = tmp_path / "devices.tokens"
    tokens.write_text(f"orin-1:{token_hash('tok-a')}\npi-2:{token_hash('tok-b')}\n")
    server = ServerProcess("--target", "random:llama-tiny", "--max-seq-len", "256", "--auth-tokens-file", str(tokens))
    address = server.start()

    async def open_with(token):
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg(tiny, token=token))
            try:
                return (await call.read()).WhichOneof("kind")
            except grpc.aio.AioRpcError as err:
                return err.code()
            finally:
                call.cancel()

    try:
        assert run(open_with("tok-a")) == "opened" and run(open_with("tok-b")) == "opened"
        tokens.write_text(f"pi-2:{token_hash('tok-b')}\n")
        server.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "SIGHUP: 1 device tokens loaded" in server.log.read_text(), 30)
        assert run(open_with("tok-a")) == grpc.StatusCode.UNAUTHENTICATED
        assert run(open_with("tok-b")) == "opened"
        tokens.write_text("pi-2 without a hash\n")  # a broken file keeps the tokens in force
        server.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "the device tokens read before stay in force" in server.log.read_text(), 30)
        assert run(open_with("tok-b")) == "opened"
        assert server.proc.poll() is None
    finally:
        server.stop()
    log = server.log.read_text()
    assert "opened for orin-1" in log and "opened for pi-2" in log and "refused an Open from 127.0.0.1" in log
