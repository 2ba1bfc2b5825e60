"""The paged KV pool in the engine: sessions hold blocks for what they hold, share a system prompt's blocks by
reference, and an exhausted pool refuses or closes one session without touching the others. The engine is driven
step by step here, without its worker thread."""

import random

import pytest
import torch

from verify_server.config import ServerConfig
from verify_server.engine import Engine
from verify_server.errors import SledError
from verify_server.sessions import DraftRequest, OpenRequest, SamplingParams, Verdict

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny():
    from verify_server.model_loader import load_target

    return load_target("random:llama-tiny", torch.device("cpu"), torch.float32)


class Driver:
    """Opens, verifies and steps an engine in the test's thread, keeping every answer."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def open(self, context: list[int], max_tokens: int = 64):
        out = []
        self.engine._handle("open", (OpenRequest(tuple(context), SamplingParams(), max_tokens, frozenset()), None),
                            out.append)
        return out[0]

    def verify(self, session, draft: list[int]) -> list:
        out = []
        self.engine._handle("verify", (session.id, DraftRequest(1, tuple(draft)), 0.0), out.append)
        return out

    def prefill_all(self) -> None:
        for _ in range(10_000):
            if not self.engine._prefilling():
                return
            self.engine.step()
        raise AssertionError("prefill did not finish")

    def run(self, answers: list[list]) -> None:
        for _ in range(10_000):
            if all(answers):
                return
            self.engine.step()
        raise AssertionError("verdicts did not come")


def prompts(n: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def test_256_sessions_of_200_tokens_are_live_at_once_in_the_bytes_of_32_slots_of_2048(tiny):
    config = ServerConfig(max_sessions=256, max_seq_len=2048, kv_cache_tokens=32 * 2048, prefix_cache_tokens=0,
                          max_batch_sessions=64, max_batch_tokens=2048, fused_max_tokens=0)
    engine = Engine(config, tiny)
    drive = Driver(engine)
    sessions = [drive.open(p) for p in prompts(256, 200, seed=1)]
    assert all(not isinstance(s, Exception) for s in sessions)
    drive.prefill_all()
    answers = [drive.verify(s, [7, 8, 9, 10]) for s in sessions]
    drive.run(answers)
    assert all(isinstance(a[0], Verdict) for a in answers)
    pool = engine.kv.blocks
    # each holds the blocks of at most 205 positions: 13 of 16 tokens, where a slot of 2048 would be 128
    assert pool.num_used <= 256 * 13 and pool.num_blocks == 4096
    assert engine.stats()["active_sessions"] == 256 and engine.stats()["kv_blocks_used"] == pool.num_used
    for s in sessions:
        engine._close(s.id)
    assert pool.num_used == 0 and pool.num_free == 4096


def test_64_sessions_with_one_512_token_system_prompt_store_it_once(tiny):
    config = ServerConfig(max_sessions=64, max_seq_len=1024, kv_cache_tokens=64 * 1024, fused_max_tokens=0)
    engine = Engine(config, tiny)
    drive = Driver(engine)
    system = prompts(1, 512, seed=2)[0]
    first = drive.open(system + [11, 12, 13, 14, 15, 16, 17, 18])
    drive.prefill_all()
    rest = [drive.open(p) for p in prompts(63, 8, seed=3, prefix=system)]
    drive.prefill_all()
    pool = engine.kv.blocks
    # 32 blocks of the system prompt, held by all 64; each session's own last block of 8 tokens
    assert pool.num_shared == 32 and all(pool.refs[b] == 64 for b in first.blocks[:32])
    assert pool.num_used == 32 + 64
    assert all(s.blocks[:32] == first.blocks[:32] for s in rest)
    stats = engine.stats()
    assert stats["kv_blocks_shared"] == 32 and stats["kv_blocks_used"] == 96
    registry = engine.metrics.registry
    assert registry.get_sample_value("sled_kv_blocks", {"state": "shared"}) == 32
    assert registry.get_sample_value("sled_kv_blocks", {"state": "used"}) == 96
    assert stats["prefix_cache_hit_tokens"] == 63 * 512
    assert stats["prefill_tokens"] == 519 + 63 * 7
    # what the sharing sessions decode is what they would have decoded alone
    contexts = [list(s.tokens) for s in rest[:3]]
    answers = [drive.verify(s, []) for s in [first] + rest]
    drive.run(answers)
    solo = Driver(Engine(ServerConfig(max_sessions=2, max_seq_len=1024, prefix_cache_tokens=0, fused_max_tokens=0),
                         tiny))
    for context, got in zip(contexts, answers[1:4]):
        mine = solo.open(context)
        solo.prefill_all()
        want = solo.verify(mine, [])
        solo.run([want])
        assert want[0].next_token == got[0].next_token
        solo.engine._close(mine.id)


def test_an_exhausted_pool_refuses_a_new_open_and_closes_only_the_session_that_cannot_grow(tiny):
    # 4 blocks of 16 tokens
    config = ServerConfig(max_sessions=8, max_seq_len=64, kv_cache_tokens=64, prefix_cache_tokens=0,
                          max_draft_tokens=8, max_batch_tokens=64, fused_max_tokens=0)
    engine = Engine(config, tiny)
    drive = Driver(engine)
    a, b = (drive.open(p) for p in prompts(2, 30, seed=4))  # two blocks each: the pool is full
    with pytest.raises(SledError) as refused:
        engine._open(OpenRequest((5, 6, 7), SamplingParams(), 8, frozenset()))
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert "4 blocks of 16 tokens (64 tokens)" in refused.value.message
    drive.prefill_all()
    grows, fits = drive.verify(a, [9, 9, 9, 9]), drive.verify(b, [9])  # a needs a third block, b does not
    drive.run([grows, fits])
    assert isinstance(fits[0], Verdict)
    err = grows[0]
    assert isinstance(err, SledError) and err.code == "RESOURCE_EXHAUSTED"
    assert "KV pool exhausted" in err.message and "30 committed tokens" in err.message and "reopen" in err.message
    assert a.id not in engine._sessions and b.id in engine._sessions
    # a's blocks went back: its reopen, with the whole context, resumes
    again = drive.open(a.tokens)
    drive.prefill_all()
    answer = drive.verify(again, [])
    drive.run([answer])
    assert isinstance(answer[0], Verdict)


def test_a_rollback_across_a_block_boundary_then_growth_gives_the_target_s_greedy_tokens(tiny):
    """Drafts that cross a block boundary and are rejected, then accepted ones that cross it again: every verdict's
    tokens are transformers' greedy continuation, and the blocks past each new length go back to the pool."""
    config = ServerConfig(max_sessions=2, max_seq_len=128, kv_block_size=4, kv_cache_tokens=128,
                          prefix_cache_tokens=0, fused_max_tokens=0)
    engine = Engine(config, tiny)
    drive = Driver(engine)
    prompt = prompts(1, 9, seed=5)[0]
    with torch.inference_mode():
        out = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    want = out[0, len(prompt):].tolist()
    session = drive.open(prompt)
    drive.prefill_all()
    got: list[int] = []
    for i in range(8):  # a wrong draft of 6, then the right 6, in turn
        draft = want[len(got):len(got) + 6] if i % 2 else [0] * 6
        answer = drive.verify(session, draft)
        drive.run([answer])
        verdict = answer[0]
        got += draft[:verdict.n_accepted] + [verdict.next_token]
        assert got == want[:len(got)], i
        assert verdict.n_accepted == (6 if i % 2 else 0)
        assert len(session.blocks) == -(-session.kv_len // 4)  # whole blocks past the new length were freed
    assert len(got) == 4 * 1 + 4 * 7
