"""Temperature 0 must give exactly the target's own greedy text, with drafts really exercised and batched."""

import asyncio

import pytest

from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.generation import generate
from edge_client.request import Request
from edge_client.policy import DraftPolicy
from edge_client.sampling import SamplingParams
from edge_client.transport import VerifierClient
from tests.conftest import PROMPTS, run

pytestmark = pytest.mark.model


async def _generate_all(address, tokenizer, jobs, max_tokens, draft_tokens=4, sampling=SamplingParams(), adaptive=True,
                        options=DrafterOptions(context_size=512, threads=1)):
    """jobs: list of (prompt_ids, drafter name); all sessions run at once over one channel."""
    client = VerifierClient(address)
    drafters = [create_drafter(name, options) for _, name in jobs]
    try:
        return await asyncio.gather(
            *[
                generate(
                    client,
                    d,
                    tokenizer,
                    Request(
                        ids,
                        max_tokens=max_tokens,
                        sampling=sampling,
                        policy=DraftPolicy(draft_tokens=draft_tokens, adaptive=adaptive),
                    ),
                )
                for (ids, _), d in zip(jobs, drafters)
            ]
        )
    finally:
        await client.close()
        for d in drafters:
            d.close()


def test_greedy_equals_target_only_decoding_on_20_prompts(make_server, tokenizer, reference_greedy):
    server = make_server()
    prompts = [tokenizer.encode(p) for p in PROMPTS[:20]]
    results = run(_generate_all(server.address, tokenizer, [(ids, "llama-cpp") for ids in prompts], 64))
    for ids, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(tuple(ids), 64), tokenizer.decode(ids)
    accepted = sum(r.accepted_tokens for r in results)
    drafted = sum(r.draft_tokens for r in results)
    assert drafted > 0 and accepted > 0
    assert sum(len(r.token_ids) for r in results) > sum(r.rounds for r in results)  # > 1 token per round
    assert sum(r.ahead_rounds for r in results) > 0  # drafts made ahead with llama.cpp's cache were used
    stats = server.engine.stats()
    assert stats["accepted_tokens"] == accepted


def test_concurrent_sessions_each_correct_while_batched(make_server, tokenizer, reference_greedy):
    server = make_server(max_wait_ms=20.0)
    drafters = ["llama-cpp", "ngram", "none", "stacked", "ngram", "llama-cpp", "none", "stack:cacheback+llama-cpp",
                "llama-cpp", "ngram"]
    prompts = [tokenizer.encode(p) for p in PROMPTS[10:20]]
    results = run(_generate_all(server.address, tokenizer, list(zip(prompts, drafters)), 48))
    for ids, name, result in zip(prompts, drafters, results):
        assert result.token_ids == reference_greedy(tuple(ids), 48), (name, tokenizer.decode(ids))
    assert server.engine.stats()["max_step_sessions"] > 1
    assert server.engine.stats()["active_sessions"] == 0
    assert server.engine.free_sessions() == server.engine.config.max_sessions


def test_seeded_sampling_is_reproducible_and_uses_draft_distributions(make_server, tokenizer):
    server = make_server()
    prompt = tokenizer.encode(PROMPTS[2])

    def sample(seed):
        sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
        # Reproducible with a fixed K: the adaptive K follows timing, and K decides how draws are consumed.
        return run(_generate_all(server.address, tokenizer, [(prompt, "llama-cpp")], 40, sampling=sampling,
                                 adaptive=False))[0]

    a, b, c = sample(11), sample(11), sample(12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert a.accepted_tokens > 0


def test_runner_logits_match_transformers(target):
    import torch

    from kernels.attention import Segment
    from verify_server.kv_cache import KVCache, KVLayout
    from verify_server.model_runner import ModelInput, ModelRunner

    cfg = target.model.config
    kv = KVCache(KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, 64), 12, 16, 64)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 2, 30, 31]
    with torch.inference_mode():
        want = target.model(torch.tensor([ids])).logits[0]
    # The fused CPU step takes every batch here (up to 64 tokens); the others are PyTorch only.
    for attention, linear, fused in (("sdpa", "onednn", "on"), ("sdpa", "onednn", "off"),
                                     ("reference", "reference", "off"), ("sdpa", "reference", "off")):
        runner = ModelRunner(target.model, kv, attention, linear, fused, fused_max_tokens=64)
        assert runner.linear == linear and (runner.fused is not None) == (fused == "on")
        a, b = kv.blocks.allocate(1), kv.blocks.allocate(1)
        # Session a: whole sequence at once. Session b: 7 tokens, then the other 5 against the cache.
        got = runner.forward(ModelInput.build(ids + ids[:7], [Segment(tuple(a), 0, 12, 12, 16),
                                                              Segment(tuple(b), 12, 7, 7, 16)], list(range(19))))
        assert torch.allclose(got[:12], want, atol=2e-3)
        assert torch.allclose(got[12:], want[:7], atol=2e-3)
        got = runner.forward(ModelInput.build(ids[7:], [Segment(tuple(b), 0, 5, 12, 16)], list(range(5))))
        assert torch.allclose(got, want[7:], atol=2e-3)
        kv.release(a)
        kv.release(b)


def test_prompts_sharing_a_system_prompt_reuse_its_kv_and_decode_unchanged(make_server, tokenizer, reference_greedy,
                                                                            target):
    import torch

    from edge_client.workload import QUESTIONS
    from verify_server.kv_cache import chain_hashes

    server = make_server()
    prompts = [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": q}])) for q in QUESTIONS[:6]]
    shared = min(next(i for i, (a, b) in enumerate(zip(p, prompts[0])) if a != b) for p in prompts[1:])
    engine = server.engine
    bs = engine.kv.block_size
    full = shared // bs * bs  # the whole blocks of what they share
    assert full >= 16  # the chat template's system prompt
    # One prompt first: its full blocks are published; then five that start with the same system prompt.
    first = run(_generate_all(server.address, tokenizer, [(prompts[0], "llama-cpp")], 32))
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    blocks = engine.kv.blocks.lookup(chain_hashes(prompts[0][:full], bs))
    assert len(blocks) == full // bs
    # The kept keys and values are the target's own for those tokens (transformers, computed alone).
    rows = engine.kv.rows(blocks, 0, full)
    with torch.inference_mode():
        past = target.model(torch.tensor([prompts[0][:full]]), use_cache=True).past_key_values
    for layer in (0, target.model.config.num_hidden_layers - 1):
        k, v = (past.layers[layer].keys, past.layers[layer].values) if hasattr(past, "layers") else past[layer]
        assert torch.allclose(engine.kv.k[layer][:, rows], k[0], atol=2e-3)
        assert torch.allclose(engine.kv.v[layer][:, rows], v[0], atol=2e-3)
    engine.kv.blocks.free(blocks)
    rest = run(_generate_all(server.address, tokenizer, [(ids, "llama-cpp") for ids in prompts[1:]], 32))
    for ids, result in zip(prompts, first + rest):
        assert result.token_ids == reference_greedy(tuple(ids), 32), tokenizer.decode(ids)
    stats = engine.stats()
    # each of the five shares at least the system prompt's blocks (two of them may share more, by chance)
    assert stats["prefix_cache_hit_tokens"] >= 5 * full
    assert stats["prefill_tokens"] + stats["prefix_cache_hit_tokens"] == sum(len(p) - 1 for p in prompts)
    assert engine.free_sessions() == engine.config.max_sessions and engine.kv.blocks.num_used == 0
