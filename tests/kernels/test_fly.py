"""FLy's loose verification as token tables: which mismatches it accepts, in the style of the greedy tests."""

import math

import torch

from kernels.rejection_sampler import DraftBatch, SamplingBatch, rejection_sample
from verify_server.fly import top3_entropy
from verify_server.verification import Exact, Fly, rule_batch


def fly(window: int = 3, threshold: float = 0.3) -> Fly:
    return Fly({"window": window, "entropy_threshold": threshold})

V = 12
UNSURE, SURE = "unsure", "sure"


def row(top: int, kind: str = SURE, impossible: int | None = None) -> torch.Tensor:
    """Logits whose argmax is `top`: sure (one token far ahead) or unsure (three tokens nearly tied, `top` first);
    `impossible` gets a logit whose float32 probability is zero (-inf would be a non-finite row, an error)."""
    logits = torch.zeros(V)
    if kind == SURE:
        logits[top] = 20.0
    else:
        logits[[(top + 1) % V, (top + 2) % V]] = 4.0
        logits[top] = 4.1
    if impossible is not None:
        logits[impossible] = -200.0
    return logits


def verify(draft: list[int], rows: list[torch.Tensor], window: int = 3, threshold: float = 0.3):
    """One greedy request: its draft and the target's rows (one per draft token and the bonus row)."""
    assert len(rows) == len(draft) + 1
    sampling = SamplingBatch(torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1), (None,),
                             rules=rule_batch([fly(window, threshold)]))
    q_ids = torch.tensor(draft).view(-1, 1)
    out = rejection_sample(torch.stack(rows), DraftBatch(torch.tensor(draft), torch.tensor([0, len(draft)]), q_ids, torch.ones(len(draft), 1)), sampling)
    return int(out.num_accepted[0]), int(out.next_token[0]), int(out.num_loose[0])


def test_entropy_of_the_top_three():
    assert top3_entropy(row(1, SURE)[None]).item() < 0.01
    p = torch.softmax(row(1, UNSURE), -1).topk(3).values
    assert abs(top3_entropy(row(1, UNSURE)[None]).item() - float(-(p * p.log()).sum())) < 1e-5
    # p from the full softmax, not renormalized over the three: a flat row of 12 gives 3 * ln(12) / 12, not ln 3
    assert abs(top3_entropy(torch.zeros(1, V)).item() - 3 * math.log(V) / V) < 1e-5


def test_an_unsure_mismatch_the_target_agrees_around_is_accepted_loosely():
    # draft 5 7 8 9: the target would say 6 where the draft says 5, unsure, then agrees on 7 and 8 (W = 3)
    draft = [5, 7, 8, 9]
    rows = [row(6, UNSURE), row(7), row(8), row(9), row(10)]
    assert verify(draft, rows) == (4, 10, 1)  # all four, one of them loosely, and the bonus
    assert verify(draft, rows, window=0) == (0, 6, 0)  # exact: the mismatch rejects, the target's 6 follows


def test_a_sure_mismatch_is_rejected_as_before():
    assert verify([5, 7, 8, 9], [row(6, SURE), row(7), row(8), row(9), row(10)]) == (0, 6, 0)
    # below the threshold: the unsure row's entropy (~1.1) under a threshold of 2 counts as sure
    assert verify([5, 7, 8, 9], [row(6, UNSURE), row(7), row(8), row(9), row(10)], threshold=2.0) == (0, 6, 0)


def test_a_mismatch_the_target_does_not_correct_around_is_rejected():
    # after the variant the target disagrees at the next position: no agreement, no override
    assert verify([5, 7, 8, 9], [row(6, UNSURE), row(3), row(8), row(9), row(10)]) == (0, 6, 0)


def test_a_mismatch_in_the_draft_s_last_w_positions_is_rejected():
    # the mismatch at the third of four tokens has one token after it, W - 1 = 2 needed
    assert verify([1, 2, 5, 9], [row(1), row(2), row(6, UNSURE), row(9), row(10)]) == (2, 6, 0)
    # with W = 2 its one agreeing token would do, but it lies in the last W positions: kept out, as in the paper
    assert verify([1, 2, 5, 9], [row(1), row(2), row(6, UNSURE), row(9), row(10)], window=2) == (2, 6, 0)
    # one position earlier it is accepted
    assert verify([1, 5, 8, 9], [row(1), row(6, UNSURE), row(8), row(9), row(10)], window=2) == (4, 10, 1)
    # a draft of exactly W tokens: its window fits, but the mismatch is in the last W positions
    assert verify([5, 7, 8], [row(6, UNSURE), row(7), row(8), row(9)]) == (0, 6, 0)


def test_a_draft_token_the_target_gives_no_probability_is_rejected():
    rows = [row(6, UNSURE, impossible=5), row(7), row(8), row(9), row(10)]
    assert verify([5, 7, 8, 9], rows) == (0, 6, 0)


def test_exact_rows_of_the_batch_stay_exact_beside_a_fly_request():
    draft = [5, 7, 8, 9]
    rows = [row(6, UNSURE), row(7), row(8), row(9), row(10)]
    logits = torch.stack(rows + rows)
    sampling = SamplingBatch(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2), (None, None),
                             rules=rule_batch([fly(), Exact({})]))
    q = torch.tensor(draft + draft).view(-1, 1)
    out = rejection_sample(logits, DraftBatch(torch.tensor(draft + draft), torch.tensor([0, 4, 8]), q, torch.ones(8, 1)), sampling)
    assert out.num_accepted.tolist() == [4, 0] and out.next_token.tolist() == [10, 6]
    assert out.num_loose.tolist() == [1, 0]


def test_each_session_in_a_step_is_judged_by_its_own_rule_and_parameters():
    """Three sessions of one step, batched: FLy at W = 2 (the mismatch at the third of four tokens is kept), FLy at
    W = 3 (it is not: too close to the draft's end) and exact, each verified as it is alone."""
    draft = [1, 5, 8, 9]
    rows = [row(1), row(6, UNSURE), row(8), row(9), row(10)]
    alone = [verify(draft, rows, window=2), verify(draft, rows, window=3)]
    assert alone == [(4, 10, 1), (1, 6, 0)]
    sampling = SamplingBatch(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3), (None,) * 3,
                             rules=rule_batch([fly(2), fly(3), Exact({})]))
    q = torch.tensor(draft * 3).view(-1, 1)
    out = rejection_sample(torch.stack(rows * 3), DraftBatch(torch.tensor(draft * 3), torch.tensor([0, 4, 8, 12]), q, torch.ones(12, 1)), sampling)
    got = list(zip(out.num_accepted.tolist(), out.next_token.tolist(), out.num_loose.tolist()))
    assert got == alone + [(1, 6, 0)]


def test_a_step_without_draft_tokens_gives_each_fly_session_the_target_s_token():
    """Sessions the server decodes send no drafts: a step of them has no draft tokens, and FLy has nothing to judge."""
    rows = [row(4), row(9)]
    sampling = SamplingBatch(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2), (None, None),
                             rules=rule_batch([fly(), Exact({})]))
    empty = DraftBatch(torch.zeros(0, dtype=torch.long), torch.tensor([0, 0, 0]), torch.zeros(0, 1, dtype=torch.long),
                       torch.zeros(0, 1))
    out = rejection_sample(torch.stack(rows), empty, sampling)
    assert out.num_accepted.tolist() == [0, 0] and out.next_token.tolist() == [4, 9]
    assert out.num_loose.tolist() == [0, 0]
