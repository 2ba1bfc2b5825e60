import pytest
import torch

from kernels import attention
from kernels.attention import (ATTENTION, BATCH_MAX_TOKENS, Segment, attention_batched, attention_plan, attention_reference,
                               attention_sdpa, batch_plan, causal_masks)
from verify_server.errors import SledError
from verify_server.kv_cache import BlockPool, KVCache, KVLayout, chain_hashes


def test_blocks_allocate_all_or_none_and_the_refusal_names_the_pool():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1 and pool.num_used == 3
    with pytest.raises(SledError) as err:
        pool.allocate(2)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert "4 blocks of 16 tokens (64 tokens)" in err.value.message and "kv_cache_tokens" in err.value.message
    assert pool.num_free == 1  # nothing taken by the refused call
    pool.free(a[:1])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="not held"):
        pool.free(a[:1])


def test_a_rollback_frees_the_whole_blocks_past_the_new_length_and_growing_takes_them_again():
    kv = KVCache(KVLayout(1, 1, 2), 8, 4, 32)
    table: list[int] = []
    kv.grow(table, 13)  # positions 0..12: four blocks
    assert len(table) == 4 and kv.blocks.num_free == 4
    kv.truncate(table, 9)  # positions 0..8: three blocks, the last one part-used
    assert len(table) == 3 and kv.blocks.num_free == 5
    kv.truncate(table, 8)  # exactly two blocks
    assert len(table) == 2 and kv.blocks.num_free == 6
    kv.grow(table, 9)
    assert len(table) == 3
    with pytest.raises(SledError):
        kv.grow(table, 33)  # 9 blocks: more than the pool
    assert len(table) == 3 and kv.blocks.num_free == 5  # all or none
    kv.release(table)
    assert table == [] and kv.blocks.num_free == 8


def test_published_prefix_blocks_are_shared_by_reference_and_kept_idle_up_to_their_budget():
    pool = BlockPool(8, 4, prefix_cache_tokens=8)  # two idle blocks kept
    prompt = list(range(100, 113))  # 13 tokens: three full blocks
    hashes = chain_hashes(prompt, 4)
    assert len(hashes) == 3 and chain_hashes(prompt[:8], 4) == hashes[:2]
    assert chain_hashes([0] + prompt[1:], 4)[1] != hashes[1]  # a block's hash depends on every token before it
    first = pool.allocate(4)
    pool.publish(first[:3], hashes)
    second = pool.lookup(chain_hashes(prompt[:8] + [7, 7, 7, 7], 4))  # shares the first two blocks only
    assert second == first[:2] and pool.num_shared == 2 and pool.num_cached == 3
    pool.free(first)  # the first session ends: its shared blocks stay held by the second
    assert pool.num_shared == 0 and pool.num_used == 2
    assert pool.lookup(hashes) == first[:3]  # the third block was idle, holding its prefix: taken again
    pool.free(first[:3])
    pool.free(second)
    assert pool.num_free == 8 and pool.num_cached == 2  # three idle, two kept: the least recently freed goes
    assert pool.lookup(hashes) == first[:2]  # the third block, freed first, was the one let go
    pool.free(first[:2])
    pool.allocate(8)  # the pool needs every block: the idle ones give up their prefixes
    assert pool.num_cached == 0 and pool.lookup(hashes) == []


def test_with_prefix_caching_off_nothing_is_published():
    pool = BlockPool(4, 4, prefix_cache_tokens=0)
    hashes = chain_hashes(list(range(8)), 4)
    pool.publish(pool.allocate(2), hashes)
    assert pool.lookup(hashes) == [] and pool.num_cached == 0


def ragged_batch(lengths, seed, block_size=4):
    """Queries of (session, new tokens, context length) segments, 6 query heads over 2 KV heads, and a pool of
    three sessions of 48 positions. Sessions 0 and 1 hold shuffled blocks (their keys are gathered); session 2
    holds consecutive ones (read as a view)."""
    g = torch.Generator().manual_seed(seed)
    per = 48 // block_size
    k = torch.randn(2, 3 * 48, 8, generator=g)  # [kv_heads, pool_rows, dim]
    v = torch.randn(2, 3 * 48, 8, generator=g)
    order = torch.randperm(2 * per, generator=g).tolist()
    tables = [tuple(order[:per]), tuple(order[per:]), tuple(range(2 * per, 3 * per))]
    segments, start = [], 0
    for slot, length, context in lengths:
        segments.append(Segment(tables[slot], start, length, context, block_size))
        start += length
    return torch.randn(start, 6, 8, generator=g), k, v, segments


def past_context(seg: Segment) -> torch.Tensor:
    """The pool rows of the session's positions from its context_len to the end of its blocks."""
    rows = (torch.tensor(seg.blocks)[:, None] * seg.block_size + torch.arange(seg.block_size)).flatten()
    return rows[seg.context_len:]


def test_a_segment_reads_consecutive_blocks_as_a_view_and_others_gathered():
    assert Segment((3, 4, 5), 0, 1, 10, 4).keys == slice(12, 22)
    assert torch.equal(Segment((5, 3, 4), 0, 1, 10, 4).keys,
                       torch.tensor([20, 21, 22, 23, 12, 13, 14, 15, 16, 17]))
    assert Segment((9, 2), 0, 1, 3, 4).keys == slice(36, 39)  # only the blocks the context reaches count


@pytest.mark.parametrize("lengths", [[(2, 5, 12), (0, 1, 7), (1, 3, 3)],  # draft, decode and prompt segments
                                     [(1, 1, 9)],  # one decode token: the whole output is its segment's
                                     [(0, 40, 45), (2, 1, 16), (1, 33, 40)],  # past MATMUL_MAX_TOKENS: fused sdpa
                                     [(0, 32, 48)]])
def test_sdpa_attention_matches_reference_on_a_ragged_batch(lengths):
    q, k, v, segments = ragged_batch(lengths, len(lengths))
    want = attention_reference(q, k, v, segments, 0.35)
    assert torch.allclose(attention_sdpa(q, k, v, segments, 0.35), want, atol=1e-5)
    masks = causal_masks(segments, q.device, 3)
    assert torch.allclose(attention_sdpa(q, k, v, segments, 0.35, masks), want, atol=1e-5)
    # Rolling back is a length: positions past context_len never leak in.
    k2, v2 = k.clone(), v.clone()
    for seg in segments:
        k2[:, past_context(seg)] = 1e4
        v2[:, past_context(seg)] = 1e4
    assert torch.allclose(attention_reference(q, k2, v2, segments, 0.35), want)
    assert torch.allclose(attention_sdpa(q, k2, v2, segments, 0.35), want, atol=1e-5)


def test_the_reference_over_blocks_is_plain_attention_over_each_sessions_positions():
    """The reference itself, against attention written out over one session's keys in position order."""
    q, k, v, segments = ragged_batch([(0, 3, 10)], 5)
    seg = segments[0]
    keys = seg.keys
    ks, vs = k[:, keys].repeat_interleave(3, 0), v[:, keys].repeat_interleave(3, 0)  # [6, 10, 8]
    scores = q.transpose(0, 1) @ ks.transpose(1, 2) * 0.35  # [6, 3, 10]
    scores = scores.masked_fill(torch.arange(10)[None, :] > torch.arange(7, 10)[:, None], float("-inf"))
    want = (scores.softmax(-1) @ vs).transpose(0, 1)
    assert torch.allclose(attention_reference(q, k, v, segments, 0.35), want, atol=1e-6)


@pytest.mark.parametrize("lengths", [[(2, 5, 12), (0, 1, 7), (1, 3, 3)],  # draft, decode and prompt segments
                                     [(0, 1, 9), (2, 1, 30), (1, 1, 2)],  # decode tokens of unequal contexts
                                     [(0, 40, 45), (2, 1, 16), (1, 9, 40)],  # a prompt past BATCH_MAX_TOKENS
                                     [(1, 33, 48)]])  # only a long segment: nothing padded
def test_batched_attention_matches_reference_over_a_poisoned_cache(lengths):
    """The padded one-call path (CUDA's) on CPU: every short segment padded to the longest, keys gathered up to
    the longest context. Pool rows past each segment's context hold NaN and inf (an unwritten or rolled-back
    position may hold anything): none may reach any output."""
    q, k, v, segments = ragged_batch(lengths, 7 + len(lengths))
    want = attention_reference(q, k, v, segments, 0.35)
    for seg in segments:
        k[:, past_context(seg)] = float("nan")
        v[:, past_context(seg)] = float("inf")
    plan = batch_plan(segments, q.device, 3)
    assert [s.length for s in plan.rest] == [s.length for s in segments if s.length > BATCH_MAX_TOKENS]
    got = attention_batched(q, k, v, plan, 0.35)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-5)
    # What the runner calls: on CPU the per-segment masks, on CUDA the plan; both give the reference.
    assert isinstance(attention_plan(segments, "cpu", 3), list)
    assert torch.allclose(ATTENTION["sdpa"][1](q, k, v, segments, 0.35, attention_plan(segments, "cpu", 3)), want,
                          atol=1e-5)
    assert torch.allclose(ATTENTION["sdpa"][1](q, k, v, segments, 0.35, plan), want, atol=1e-5)


def test_a_pool_too_large_for_memory_is_a_clear_error():
    with pytest.raises(ValueError, match=r"KV pool of 100000000000 tokens \(.* GiB\) does not fit"):
        KVCache.create(KVLayout(1000, 8, 128), 100_000_000_000, 16, 2048)
    kv = KVCache.create(KVLayout(2, 1, 4), 100, 16, 64)
    assert kv.num_blocks == 7 and kv.blocks.num_free == 7  # rounded up to whole blocks


@pytest.mark.parametrize("lengths", [[(2, 5, 12), (0, 1, 30), (1, 3, 3)],  # a decode token far past the window
                                     [(0, 40, 45), (2, 1, 16), (1, 9, 40)]])  # a prompt longer than the window
def test_sliding_window_attention_sees_only_the_last_window_positions(lengths):
    """Sliding-window layers (Mistral, Gemma 3): each query sees its last 6 positions. The reference is checked
    against brute force first; every kernel, per segment and padded, must give it, one-token segments too."""
    q, k, v, segments = ragged_batch(lengths, 11)
    window = 6
    want = attention_reference(q, k, v, segments, 0.35, window)
    for seg in segments:  # brute force: a query at position p attends over keys (p - window, p] alone
        keys = torch.arange(seg.keys.start, seg.keys.stop) if isinstance(seg.keys, slice) else seg.keys
        for i in range(seg.length):
            p = seg.context_len - seg.length + i
            rows = keys[max(0, p - window + 1):p + 1]
            ks, vs = k[:, rows].repeat_interleave(3, 0), v[:, rows].repeat_interleave(3, 0)
            one = ((q[seg.start + i][:, None] @ ks.transpose(1, 2) * 0.35).softmax(-1) @ vs)[:, 0]
            assert torch.allclose(want[seg.start + i], one, atol=1e-5)
    assert not torch.allclose(want, attention_reference(q, k, v, segments, 0.35), atol=1e-3)  # the window matters
    masks = causal_masks(segments, q.device, 3, window=window)
    assert torch.allclose(attention_sdpa(q, k, v, segments, 0.35, masks), want, atol=1e-5)
    for seg in segments:
        k[:, past_context(seg)] = float("nan")
    assert torch.allclose(attention_batched(q, k, v, batch_plan(segments, q.device, 3, window=window), 0.35), want,
                          atol=1e-5)
    assert torch.allclose(ATTENTION["reference"][1](q, k, v, segments, 0.35,
                                                    ATTENTION["reference"][0](segments, "cpu", 3, window=window)), want)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block", [8, 16])
def test_a_long_segment_attends_in_query_blocks_over_the_keys_each_can_see(monkeypatch, window, block):
    """A prompt chunk longer than QUERY_BLOCK goes in blocks, each over key positions [lo, hi): up to its last query,
    and from its first query's window on; the result is attention over the whole context, a poisoned pool past each
    context read by none of them."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    q, k, v, segments = ragged_batch([(0, 40, 45), (2, 1, 16), (1, 33, 40)], 5)
    want = attention_reference(q, k, v, segments, 0.35, window)
    for seg in segments:
        k[:, past_context(seg)] = float("nan")
        v[:, past_context(seg)] = float("nan")
    masks = causal_masks(segments, q.device, 3, window=window)
    for seg, mask in zip(segments, masks):
        if seg.length <= block:
            assert not isinstance(mask, tuple)
            continue
        first = seg.context_len - seg.length
        assert [b.start for b in mask] == list(range(0, seg.length, block))
        for b in mask:
            assert b.hi == first + b.start + b.length  # no key past the block's last query
            assert b.lo == (0 if window is None else max(0, first + b.start - window + 1))
            assert b.mask.shape == (3 * b.length, b.hi - b.lo)
    assert torch.allclose(attention_sdpa(q, k, v, segments, 0.35, masks), want, atol=1e-5)
    plan = batch_plan(segments, q.device, 3, window=window)  # CUDA's padded path keeps long segments apart
    assert torch.allclose(attention_batched(q, k, v, plan, 0.35), want, atol=1e-5)


@pytest.mark.parametrize("window", [None, 128])
def test_a_whole_prompt_chunk_past_query_block_matches_the_reference(window):
    """At the real QUERY_BLOCK: 600 new tokens after 100 cached ones, over shuffled blocks of 16."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 768, 8, generator=g), torch.randn(2, 768, 8, generator=g)
    blocks = tuple(torch.randperm(48, generator=g).tolist()[:44])
    seg = Segment(blocks, 0, 600, 700, 16)
    q = torch.randn(600, 6, 8, generator=g)
    masks = causal_masks([seg], "cpu", 3, window=window)
    assert isinstance(masks[0], tuple) and len(masks[0]) == -(-600 // attention.QUERY_BLOCK)
    want = attention_reference(q, k, v, [seg], 0.35, window)
    assert torch.allclose(attention_sdpa(q, k, v, [seg], 0.35, masks), want, atol=1e-5)
