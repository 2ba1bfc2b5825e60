"""FLy through a server and a device: a session that asks for loose verification keeps a draft's variant the
target corrects around, an exact one does not, and the counts reach the verdicts, metrics and the device's stats."""

import asyncio

import grpc
import pytest
import torch

from edge_client.transport import VerifierClient
from edge_client.drafters.base import Proposal
from edge_client.generation import generate
from edge_client.request import Request
from edge_client.policy import DraftPolicy
from edge_client.sampling import SamplingParams
from verify_server.fly import top3_entropy
from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc
from tests.conftest import all_freed, run

pytestmark = pytest.mark.model

PROMPT = [1, 504, 3458, 314, 1345, 30]


def greedy_after(tiny, ids: list[int], n: int) -> tuple[list[int], float]:
    """The target's next n greedy tokens after ids, and the top-3 entropy of its first choice."""
    out, first_entropy = [], None
    with torch.inference_mode():
        for _ in range(n):
            logits = tiny.model(torch.tensor([ids + out])).logits[0, -1]
            if first_entropy is None:
                first_entropy = float(top3_entropy(logits[None]))
            out.append(int(logits.argmax()))
    return out, first_entropy


def variant_draft(tiny, window: int) -> tuple[list[int], list[int]]:
    """A draft whose first token differs from the target's choice and whose next window tokens are the target's own
    after that variant (W - 1 to agree on, and one more: a mismatch in a draft's last W positions stays a rejection):
    the case FLy defers. Returns (the target's greedy first token, the draft)."""
    (want,), entropy = greedy_after(tiny, PROMPT, 1)
    assert entropy < 0.3  # the random target is sure there: the default gate (0.3) keeps it exact, 0 opens it
    variant = (want + 7) % 1000
    rest, _ = greedy_after(tiny, PROMPT + [variant], window)
    return want, [variant] + rest


async def one_round(address, tiny, draft, **open_fields):
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.VerifierStub(channel).Session()
        await call.write(pb.ClientMessage(open=pb.Open(tokenizer_fingerprint=tiny.fingerprint,
                                                       context_token_ids=PROMPT, max_tokens=32, **open_fields)))
        try:
            opened = (await call.read()).opened
        except grpc.aio.AioRpcError as err:
            return None, None, err.code(), err.details()
        await call.write(pb.ClientMessage(draft=pb.Draft(session_id=opened.session_id, round=0, token_ids=draft)))
        verdict = (await call.read()).verdict
        call.cancel()
        return opened, verdict, None, None


def test_a_fly_session_keeps_a_variant_the_target_corrects_around_and_an_exact_one_does_not(make_tiny_server, tiny):
    server = make_tiny_server(verification_params=["fly:entropy_threshold=0"])
    want, draft = variant_draft(tiny, 3)

    opened, exact, _, _ = run(one_round(server.address, tiny, draft))
    assert (opened.verification, opened.min_draft_tokens) == (pb.VERIFICATION_EXACT, 0)
    assert (exact.n_accepted, exact.next_token, exact.n_loose) == (0, want, 0)

    opened, fly, _, _ = run(one_round(server.address, tiny, draft, verification=pb.VERIFICATION_FLY,
                                      verification_params={"window": 3}))
    assert (opened.verification, opened.min_draft_tokens) == (pb.VERIFICATION_FLY, 4)
    assert dict(opened.verification_params) == {"window": 3, "entropy_threshold": 0}
    assert (fly.n_accepted, fly.n_loose) == (4, 1)  # the variant and the three tokens the target agrees on after it
    assert fly.next_token == greedy_after(tiny, PROMPT + draft, 1)[0][0]  # the bonus token follows the variant
    assert server.engine.stats()["loosely_accepted_tokens"] == 1

    # where the target is sure of its choice, the entropy gate keeps FLy exact
    gated = make_tiny_server()
    _, sure, _, _ = run(one_round(gated.address, tiny, draft, verification=pb.VERIFICATION_FLY,
                                  verification_params={"window": 3}))
    assert (sure.n_accepted, sure.next_token, sure.n_loose) == (0, want, 0)
    assert all_freed(server) and all_freed(gated)


def test_fly_is_refused_for_sampling_and_by_a_server_that_does_not_allow_it(make_tiny_server, tiny):
    server = make_tiny_server()
    _, _, code, details = run(one_round(server.address, tiny, [], verification=pb.VERIFICATION_FLY,
                                        sampling=pb.SamplingParams(temperature=0.7)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "greedy generation" in details
    strict = make_tiny_server(refuse_verification=["fly"])
    _, _, code, details = run(one_round(strict.address, tiny, [], verification=pb.VERIFICATION_FLY))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "does not allow fly" in details
    assert all_freed(server) and all_freed(strict)


class Scripted:
    """A drafter that proposes the variant draft at the prompt and nothing after it."""

    name = "scripted"

    def __init__(self, draft):
        self.draft = draft

    def begin(self, context, sampling):
        pass

    def propose(self, context, k, stop=None):
        return Proposal(list(self.draft[:k]) if list(context) == PROMPT else [])

    def accept(self, context, ahead=()):
        pass

    def close(self):
        pass


def test_the_device_asks_for_fly_and_counts_what_was_accepted_loosely(make_tiny_server, tiny, tokenizer):
    server = make_tiny_server(verification_params=["fly:entropy_threshold=0"])
    want, draft = variant_draft(tiny, 3)
    fly = DraftPolicy(draft_tokens=4, adaptive=False, verification="fly:window=3")

    async def go(policy, sampling=SamplingParams()):
        client = VerifierClient(server.address)
        try:
            return await generate(
                client, Scripted(draft), tokenizer, Request(PROMPT, max_tokens=8, sampling=sampling, policy=policy)
            )
        finally:
            await client.close()

    loose = asyncio.run(go(fly))
    exact = asyncio.run(go(DraftPolicy(draft_tokens=4, adaptive=False)))
    assert loose.token_ids[:4] == draft and loose.loosely_accepted_tokens == 1
    assert loose.stats()["loosely_accepted_tokens"] == 1
    assert exact.token_ids[0] == want and exact.loosely_accepted_tokens == 0
    with pytest.raises(ValueError, match="greedy"):
        asyncio.run(go(fly, SamplingParams(temperature=0.7)))
