"""FlexAttention over the paged pool (kernels/flex.py): one compiled call for a ragged batch gives the reference's
attention, with sliding windows, over a poisoned pool, and with a tree of draft tokens in one segment."""

import pytest
import torch

from kernels.attention import Segment, attention_reference
from kernels.flex import PagedFlex, PoolShape, tree_positions

BS, BLOCKS, LENGTH = 4, 40, 64  # the pool's blocks, and the query rows every call is padded to (one compile)


@pytest.fixture(scope="module")
def flex():
    return PagedFlex(PoolShape(BLOCKS, BS, 64, "cpu"), q_block=8, max_tokens=LENGTH)


def batch(lengths, seed):
    """(new tokens, context length) segments over shuffled blocks, 6 query heads over 2 KV heads. Pool rows no
    session holds are NaN; rows past a context in its last block are 0, as the pool zeroes a block it hands out
    for FlexAttention (a kernel reads whole blocks, and 0 x NaN is NaN under a masked score)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((2, BLOCKS * BS, 8), float("nan"))
    v = torch.full((2, BLOCKS * BS, 8), float("nan"))
    order = torch.randperm(BLOCKS, generator=g).tolist()
    segments, start = [], 0
    for length, context in lengths:
        need = -(-context // BS)
        table, order = tuple(order[:need]), order[need:]
        segments.append(Segment(table, start, length, context, BS))
        rows = (torch.tensor(table)[:, None] * BS + torch.arange(BS)).flatten()
        k[:, rows], v[:, rows] = 0.0, 0.0
        k[:, rows[:context]] = torch.randn(2, context, 8, generator=g)
        v[:, rows[:context]] = torch.randn(2, context, 8, generator=g)
        start += length
    return torch.randn(start, 6, 8, generator=g), k, v, segments


@pytest.mark.parametrize("lengths", [[(5, 12), (1, 7), (3, 3)],  # draft, decode and prompt segments
                                     [(1, 30), (6, 6), (9, 40), (2, 9)]])  # q blocks holding several sessions
@pytest.mark.parametrize("window", [None, 6])
def test_one_flex_call_matches_the_reference_over_a_poisoned_pool(flex, lengths, window):
    q, k, v, segments = batch(lengths, len(lengths) + (window or 0))
    want = attention_reference(q, k, v, segments, 0.35, window)
    got = flex.attend(q, k, v, flex.prepare(segments, window, LENGTH), 0.35)  # NaN rows are never read
    assert torch.allclose(got, want, atol=1e-5)


def test_a_shared_prefix_block_is_read_by_every_session_that_holds_it(flex):
    q, k, v, segments = batch([(2, 10), (3, 11)], 3)
    shared = Segment((segments[0].blocks[0],) + segments[1].blocks[1:], 2, 3, 11, BS)  # same first block
    segments = [segments[0], shared]
    want = attention_reference(q, k, v, segments, 0.35)
    assert torch.allclose(flex.attend(q, k, v, flex.prepare(segments, None, LENGTH), 0.35), want, atol=1e-5)


def test_a_tree_of_draft_tokens_attends_along_each_branch(flex):
    """Segment 1 is a draft tree after 9 context tokens: root 0; 1 and 2 under it; 3 under 1; 4 and 5 under 2.
    Each node's output must be the attention of a chain made of the context and its branch, at the branch's
    positions; the segments around it are plain."""
    parents = [-1, 0, 0, 1, 2, 2]
    q, k, v, segments = batch([(3, 7), (6, 15), (1, 5)], 9)
    tree = segments[1]
    plan = flex.prepare(segments, None, LENGTH, trees={1: parents})
    got = flex.attend(q, k, v, plan, 0.35)
    plain = attention_reference(q, k, v, segments, 0.35)
    assert torch.allclose(got[:3], plain[:3], atol=1e-5) and torch.allclose(got[9:], plain[9:], atol=1e-5)
    context = tree.context_len - tree.length  # 9
    assert tree_positions(parents, context) == [9, 10, 10, 11, 11, 11]
    rows = (torch.tensor(tree.blocks)[:, None] * BS + torch.arange(BS)).flatten()
    for leaf, branch in ((3, [0, 1, 3]), (4, [0, 2, 4]), (5, [0, 2, 5])):
        # the branch as a chain in a pool of its own: the context's keys, then the branch's nodes in order
        chain_k = torch.cat([k[:, rows[:context]], k[:, rows[context + torch.tensor(branch)]]], 1)
        chain_v = torch.cat([v[:, rows[:context]], v[:, rows[context + torch.tensor(branch)]]], 1)
        qs = q[tree.start + torch.tensor(branch)]
        want = attention_reference(qs, chain_k, chain_v, [Segment((0,), 0, len(branch), context + len(branch),
                                                                  context + len(branch))], 0.35)
        assert torch.allclose(got[tree.start + torch.tensor(branch)], want, atol=1e-5), leaf
    with pytest.raises(ValueError, match="parent must come before"):
        flex.prepare(segments, None, LENGTH, trees={1: [-1, 2, 0, 1, 2, 2]})
