"""Structured output through a server and a device: under a constraint the text is the masked target's greedy text
(transformers' decoding with llguidance's own mask, token by token), drafts the constraint forbids are rejected,
and a constrained session batched beside a free one leaves the free one the target's own text."""

import asyncio
import json

import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest
import torch

from edge_client.drafters import create_drafter
from edge_client.generation import generate
from edge_client.policy import DraftPolicy
from edge_client.request import Request
from edge_client.transport import VerifierClient, VerifyError
from sled.constraints import Constraint
from tests.conftest import run

pytestmark = pytest.mark.model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def masked_greedy(target, prompt: list[int], constraint: Constraint, max_tokens: int) -> list[int]:
    """The target alone, greedy, each token's logits masked by llguidance's own numpy mask."""
    from llguidance.hf import from_tokenizer

    ll = from_tokenizer(target.tokenizer, n_vocab=target.vocab_size, eos_token=list(target.eos_token_ids))
    matcher = llguidance.LLMatcher(ll, constraint.grammar(), log_level=0)
    bitmask = llnp.allocate_token_bitmask(1, target.vocab_size)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = target.model(torch.tensor([prompt + out])).logits[0, -1:].float().numpy().copy()
            llnp.fill_next_token_bitmask(matcher, bitmask)
            llnp.apply_token_bitmask_inplace(logits, bitmask)
            token = int(np.argmax(logits[0]))
            out.append(token)
            if token in target.eos_token_ids:
                break
            assert matcher.consume_token(token)
    return out


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": text}]))


def test_a_constrained_greedy_generation_is_the_masked_targets_and_a_free_one_beside_it_the_targets(
        make_server, target, tokenizer, reference_greedy):
    server = make_server()
    constraint = Constraint.json_schema(SCHEMA)
    prompt = chat(tokenizer, "Give the largest city of France and its population as JSON.")
    free_prompt = chat(tokenizer, "Name three colours.")

    async def both():
        client = VerifierClient(server.address)
        try:
            return await asyncio.gather(
                generate(client, create_drafter("llama-cpp"), tokenizer,
                         Request(prompt, max_tokens=48, constraint=constraint,
                                 policy=DraftPolicy(draft_tokens=4, mask_drafts=False, forced_tokens=False))),
                generate(client, create_drafter("llama-cpp"), tokenizer,
                         Request(free_prompt, max_tokens=24, policy=DraftPolicy(draft_tokens=4))))
        finally:
            await client.close()

    structured, free = run(both())
    want = masked_greedy(target, prompt, constraint, 48)
    assert structured.token_ids == want
    assert free.token_ids == reference_greedy(tuple(free_prompt), 24)
    value = json.loads(tokenizer.decode([t for t in structured.token_ids if t not in target.eos_token_ids]))
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    # the unmasked drafter proposes free text: some of its drafts broke the schema and were cut there
    assert structured.accepted_tokens < structured.draft_tokens
    # the server counts the constrained session's drafts apart
    stats = server.engine.stats()
    assert (stats["constrained_draft_tokens"], stats["constrained_accepted_tokens"]) == (
        structured.draft_tokens, structured.accepted_tokens)


def test_the_server_decoding_alone_under_a_constraint_gives_the_same_text(make_server, target, tokenizer):
    server = make_server()
    constraint = Constraint("regex", r"(yes|no), because [a-z ]{1,40}\.")
    prompt = chat(tokenizer, "Is the sky blue? Answer yes or no and say why.")

    async def once():
        client = VerifierClient(server.address)
        try:
            return await generate(client, create_drafter("none"), tokenizer,
                                  Request(prompt, max_tokens=40, constraint=constraint))
        finally:
            await client.close()

    got = run(once())
    assert got.token_ids == masked_greedy(target, prompt, constraint, 40)
    assert got.finish_reason == "stop"


def test_a_constraint_that_does_not_compile_fails_the_open_with_the_librarys_message(make_server, tokenizer):
    server = make_server()

    async def once():
        client = VerifierClient(server.address)
        try:
            return await generate(client, create_drafter("none"), tokenizer,
                                  Request([1, 2, 3], max_tokens=4, constraint=Constraint("regex", "a(b")))
        finally:
            await client.close()

    with pytest.raises(VerifyError) as err:
        run(once())
    assert err.value.code == "INVALID_ARGUMENT" and "unclosed group" in err.value.message


def test_a_constraint_near_the_size_limit_reaches_the_server(make_server, tokenizer):
    """The server's message limit makes room for the largest constraint an Open may carry."""
    server = make_server()
    big = Constraint("lark", 'start: "ok"\n// ' + "x" * 60000)

    async def once():
        client = VerifierClient(server.address)
        try:
            return await generate(client, create_drafter("none"), tokenizer,
                                  Request(chat(tokenizer, "Say ok."), max_tokens=4, constraint=big))
        finally:
            await client.close()

    assert tokenizer.decode(run(once()).token_ids).startswith("ok")


def test_a_drafter_masked_by_the_constraint_drafts_valid_tokens_and_more_are_accepted(make_server, target, tokenizer):
    """The same request with the device's mask and without: the same text (the masked target's), and the masked
    drafts, never broken by the schema, are accepted more often. Fixed K, no drafting ahead: both runs draft alike
    apart from the mask."""
    server = make_server()
    constraint = Constraint.json_schema(SCHEMA)
    prompt = chat(tokenizer, "Give a big city of Italy and its population as JSON.")

    async def once(mask: bool, forced: bool = False):
        client = VerifierClient(server.address)
        policy = DraftPolicy(draft_tokens=6, adaptive=False, draft_ahead=False, mask_drafts=mask,
                             forced_tokens=forced)
        try:
            return await generate(client, create_drafter("llama-cpp"), tokenizer,
                                  Request(prompt, max_tokens=48, policy=policy, constraint=constraint))
        finally:
            await client.close()

    masked, free, jumped = run(once(True)), run(once(False)), run(once(True, forced=True))
    assert masked.token_ids == free.token_ids == jumped.token_ids == masked_greedy(target, prompt, constraint, 48)
    assert masked.acceptance_rate > free.acceptance_rate
    assert masked.rounds < free.rounds
    assert masked.forced_tokens == free.forced_tokens == 0
    # the keys, quotes and colons the schema forces are drafted without the drafter, and accepted as any other
    assert jumped.forced_tokens >= 4 and jumped.rounds <= masked.rounds
