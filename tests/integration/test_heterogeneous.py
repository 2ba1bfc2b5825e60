"""One server, devices with different drafters at once: every output is the target's own."""

import asyncio

import pytest

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.generation import generate
from edge_client.request import Request
from edge_client.models import default_model_path
from edge_client.policy import DraftPolicy
from edge_client.tokenizer import Tokenizer
from edge_client.transport import VerifierClient, VerifyError
from tests.conftest import PROMPTS, run
from tests.gguf_vocab import with_changed_token

pytestmark = pytest.mark.model


def test_mixed_drafters_on_one_server_each_get_the_target_text(make_server, tokenizer, reference_greedy,
                                                                requantized_gguf, onnx_drafts):
    server = make_server(max_wait_ms=10.0)
    devices = {
        "llama-cpp Q4_1": ("llama-cpp", DrafterOptions(context_size=512, threads=1)),
        "llama-cpp requantized": ("llama-cpp", DrafterOptions(model_path=str(requantized_gguf), context_size=512,
                                                               threads=1)),
        "onnx int8, 6 layers": ("onnx", DrafterOptions(onnx_model=str(onnx_drafts["int8"]), threads=1)),
        "cacheback": ("cacheback", DrafterOptions()),
        "prompt lookup": ("ngram", DrafterOptions()),
        "prompt lookup under onnx": ("stack:ngram+onnx", DrafterOptions(onnx_model=str(onnx_drafts["int8"]),
                                                                       threads=1)),
    }
    prompts = {name: tokenizer.encode(PROMPTS[i]) for i, name in enumerate(devices, start=5)}

    async def go():
        client = VerifierClient(server.address)
        drafters = {name: create_drafter(kind, opts) for name, (kind, opts) in devices.items()}
        try:
            results = await asyncio.gather(
                *[
                    generate(
                        client,
                        drafters[name],
                        tokenizer,
                        Request(prompts[name], max_tokens=40, policy=DraftPolicy(draft_tokens=4)),
                    )
                    for name in devices
                ]
            )
        finally:
            await client.close()
            for d in drafters.values():
                d.close()
        return dict(zip(devices, results))

    results = run(go())
    for name, result in results.items():
        assert result.token_ids == reference_greedy(tuple(prompts[name]), 40), name
    for name in ("llama-cpp Q4_1", "llama-cpp requantized", "onnx int8, 6 layers"):
        assert results[name].draft_tokens > 0 and results[name].accepted_tokens > 0, name
    assert server.engine.stats()["max_step_sessions"] > 1


def test_a_drafter_with_another_vocabulary_is_refused_naming_both(make_server, tmp_path, target):
    server = make_server()
    other = with_changed_token(default_model_path(), tmp_path / "other-vocab.gguf", 49151, "not-the-target's")
    tok = Tokenizer(other)
    drafter = create_drafter("llama-cpp", DrafterOptions(model_path=str(other), context_size=256, threads=1))

    async def go():
        client = VerifierClient(server.address)
        try:
            await generate(client, drafter, tok, Request(tok.encode("Hello"), max_tokens=8))
        finally:
            await client.close()

    with pytest.raises(VerifyError) as err:
        run(go())
    drafter.close()
    assert err.value.code == "FAILED_PRECONDITION"
    assert tok.fingerprint in err.value.message and target.fingerprint in err.value.message
