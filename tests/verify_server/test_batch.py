"""A step's batch, built once: the model's input in the engine's layout, and the drafts' sparse distributions padded
once to the step's widest, each draft clipped to what its session can still take."""

import numpy as np
import pytest
import torch

from verify_server.batch import StepBatch
from verify_server.scheduler import Plan, PrefillWork, VerifyWork
from verify_server.sessions import DraftRequest, SamplingParams, Session, SparseQ


def session(i, tokens, kv_len, remaining=10, temperature=0.0):
    # session i holds blocks [10 i, 10 i + 1, ...] of 4 positions
    return Session(id=f"s{i}", blocks=[10 * i + j for j in range(4)], tokens=list(tokens), sampling=SamplingParams(temperature=temperature),
                   remaining=remaining, stop_ids=frozenset(), generator=None, kv_len=kv_len)


def q(*rows):
    """A SparseQ from rows of (id, prob) pairs."""
    return SparseQ(np.array([len(r) for r in rows]), np.array([i for r in rows for i, _ in r]),
                   np.array([p for r in rows for _, p in r], dtype=np.float32))


def test_the_batch_lays_out_prefill_then_verifications_and_pads_q_once():
    cold = session(0, [1, 2, 3, 4, 5], kv_len=1)
    greedy = session(1, [7, 8], kv_len=1)
    sampled = session(2, [9], kv_len=0, temperature=0.8)
    plan = Plan([VerifyWork(greedy, DraftRequest(0, (20, 21)), None),
                 VerifyWork(sampled, DraftRequest(0, (30, 31, 32), q([(30, 0.5), (33, 0.5)], [(31, 1.0)],
                                                                     [(32, 0.2), (34, 0.3), (35, 0.5)])), None)],
                [PrefillWork(cold, 3)])
    b = StepBatch.build(plan, max_seq_len=64, default_gen=None, block_size=4)
    # the prompt chunk (positions 1-3 of session 0), then each verification's last token and its draft
    assert b.model_input.token_ids.tolist() == [2, 3, 4, 8, 20, 21, 9, 30, 31, 32]
    assert b.model_input.positions.tolist() == [1, 2, 3, 1, 2, 3, 0, 1, 2, 3]
    assert b.model_input.rows.tolist() == [1, 2, 3, 41, 42, 43, 80, 81, 82, 83]  # block 10 i, rows 40 i on
    assert b.model_input.tables.tolist() == [[0, 1, 2, 3]] * 3 + [[10, 11, 12, 13]] * 3 + [[20, 21, 22, 23]] * 4
    assert b.model_input.logit_rows.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert b.spec.token_ids.tolist() == [20, 21, 30, 31, 32] and b.spec.cu_num_draft_tokens.tolist() == [0, 2, 5]
    # one padding, to the widest distribution of the step (3); a deterministic draft is q = 1 on its token
    assert b.spec.q_ids.tolist() == [[20, 0, 0], [21, 0, 0], [30, 33, 0], [31, 0, 0], [32, 34, 35]]
    assert torch.allclose(b.spec.q_probs, torch.tensor([[1, 0, 0], [1, 0, 0], [0.5, 0.5, 0], [1, 0, 0], [0.2, 0.3, 0.5]]))
    assert b.sampling.temperature.tolist() == pytest.approx([0.0, 0.8])


def test_a_draft_is_clipped_to_what_its_session_can_take_with_its_q():
    near_end = session(0, [1, 2], kv_len=1, remaining=3)  # 3 more tokens: 2 drafted and the verdict's own
    full = session(1, [1] * 15, kv_len=14)  # 16 positions, 14 in the KV: its last token, one draft token, no more
    plan = Plan([VerifyWork(near_end, DraftRequest(0, (5, 6, 7, 8), q([(5, 1.0)], [(6, 0.5), (9, 0.5)],
                                                                      [(7, 1.0)], [(8, 1.0)])), None),
                 VerifyWork(full, DraftRequest(0, (5, 6, 7)), None)], [])
    b = StepBatch.build(plan, max_seq_len=16, default_gen=None, block_size=4)
    assert b.drafts == [[5, 6], [5]]
    assert b.spec.q_ids.tolist() == [[5, 0], [6, 9], [5, 0]]
    # the subset left after a session's logits were not finite: its own rows, its own q
    part = b.subset([1])
    assert part.drafts == [[5]] and part.spec.cu_num_draft_tokens.tolist() == [0, 1] and part.spec.q_ids.tolist() == [[5]]
    assert b.logit_rows([1]).tolist() == [3, 4]  # after the first verification's 3 rows
