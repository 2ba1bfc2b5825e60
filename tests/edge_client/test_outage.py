"""A device whose verify server is down: each fallback policy answers within its bounds and says what it does.

No server listens on the port: a real gRPC channel finds the connection refused.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.generation import generate
from edge_client.request import Callbacks, Request
from edge_client.resilience import Resilience
from edge_client.policy import DraftPolicy
from edge_client.transport import VerifierClient, VerifyError
from sim.processes import free_port

TOKENIZER = SimpleNamespace(eos_token_id=2, fingerprint="test",
                            stream_decoder=lambda: SimpleNamespace(feed=lambda ids: "", flush=lambda: ""))
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]  # the n-gram drafter continues it: 7 5 6 7 ...


def _run(resilience: Resilience, max_tokens: int = 8):
    statuses: list[str] = []

    async def go():
        client = VerifierClient(f"127.0.0.1:{free_port()}")
        try:
            return await generate(
                client,
                create_drafter("ngram", DrafterOptions()),
                TOKENIZER,
                Request(PROMPT, max_tokens=max_tokens, policy=DraftPolicy(draft_tokens=3, adaptive=False)),
                resilience=resilience,
                callbacks=Callbacks(on_status=statuses.append),
            )
        finally:
            await client.close()

    t0 = time.monotonic()
    try:
        return asyncio.run(go()), statuses, time.monotonic() - t0
    except VerifyError as err:
        return err, statuses, time.monotonic() - t0


def test_the_wait_deadline_bounds_the_whole_wait_with_the_default_round_timeout():
    # The round timeout (30 s) bounds one Open; the wait deadline bounds them all. Each Open waiting for the server
    # for the whole round timeout, and the deadline counted from the first failure, made this wait about 60 s.
    err, statuses, took = _run(Resilience(wait_deadline_s=1.5))
    assert isinstance(err, VerifyError) and err.code == "DEADLINE_EXCEEDED"
    assert "wait deadline of 1.5s" in err.message
    assert 1.4 < took < 30  # the deadline waited out, not the round timeout (30 s) once more
    # told at the first failed attempt, not after the round timeout
    assert len(statuses) == 1 and "unreachable" in statuses[0] and "waiting up to 1.5s" in statuses[0]


def test_the_fail_policy_fails_at_once_naming_the_server():
    err, statuses, took = _run(Resilience(fallback="fail"))
    assert isinstance(err, VerifyError) and err.code == "UNAVAILABLE"
    assert "fallback policy is fail" in err.message and "127.0.0.1:" in err.message
    assert took < 30 and statuses == []  # at once: not after the round timeout (30 s)


def test_the_local_policy_goes_on_with_the_drafter_and_says_so():
    result, statuses, _ = _run(Resilience(fallback="local"), max_tokens=6)
    assert result.token_ids == [7, 5, 6, 7, 5, 6] and result.unverified_tokens == 6
    assert len(statuses) == 1 and "drafter alone" in statuses[0]


@pytest.mark.parametrize("address", ["127.0.0.1:", "127.0.0.1:99999", ":50051", "localhost"])
def test_a_server_address_without_a_usable_port_is_refused(address):
    from edge_client.config import EdgeConfig, check_server

    with pytest.raises(ValueError, match="HOST:PORT"):
        check_server(address)
    with pytest.raises(ValueError, match="HOST:PORT"):
        EdgeConfig(server=address)
