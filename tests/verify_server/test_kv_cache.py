import pytest
import torch

from kernels.attention import (ATTENTION, BATCH_MAX_TOKENS, Segment, attention_batched, attention_plan, attention_reference,
                               attention_sdpa, batch_plan, causal_masks)
from verify_server.errors import SledError
from verify_server.kv_cache import KVCache


def test_slots_allocate_free_and_refuse_when_full():
    kv = KVCache(2, 2, 1, 8, 4, torch.float32, torch.device("cpu"))
    a, b = kv.allocate(), kv.allocate()
    assert {a, b} == {0, 1} and kv.num_free == 0
    with pytest.raises(SledError) as err:
        kv.allocate()
    assert err.value.code == "RESOURCE_EXHAUSTED" and "2 session slots" in err.value.message
    kv.free(a)
    assert kv.allocate() == a
    with pytest.raises(ValueError):
        kv.free(7)


def ragged_batch(lengths, seed):
    """Queries of (slot, new tokens, context length) segments, 6 query heads over 2 KV heads, and a cache of 3 slots."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(3, 2, 48, 8, generator=g)  # [slots, kv_heads, max_len, dim]
    v = torch.randn(3, 2, 48, 8, generator=g)
    segments, start = [], 0
    for slot, length, context in lengths:
        segments.append(Segment(slot, start, length, context))
        start += length
    return torch.randn(start, 6, 8, generator=g), k, v, segments


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
        k2[seg.slot, :, seg.context_len:] = 1e4
        v2[seg.slot, :, seg.context_len:] = 1e4
    assert torch.allclose(attention_reference(q, k2, v2, segments, 0.35), want)
    assert torch.allclose(attention_sdpa(q, k2, v2, segments, 0.35), want, atol=1e-5)


@pytest.mark.parametrize("lengths", [[(2, 5, 12), (0, 1, 7), (1, 3, 3)],  # draft, decode and prompt segments
                                     [(0, 1, 9), (2, 1, 30), (1, 1, 2)],  # decode tokens of unequal contexts
                                     [(0, 40, 45), (2, 1, 16), (1, 9, 40)],  # a prompt past BATCH_MAX_TOKENS
                                     [(1, 33, 48)]])  # only a long segment: nothing padded
def test_batched_attention_matches_reference_over_a_poisoned_cache(lengths):
    """The padded one-call path (CUDA's) on CPU: every short segment padded to the longest, keys gathered up to
    the longest context. Cache positions past each segment's context hold NaN and inf (an unwritten or rolled-back
    position may hold anything): none may reach any output."""
    q, k, v, segments = ragged_batch(lengths, 7 + len(lengths))
    want = attention_reference(q, k, v, segments, 0.35)
    for seg in segments:
        k[seg.slot, :, seg.context_len:] = float("nan")
        v[seg.slot, :, seg.context_len:] = float("inf")
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


def test_a_cache_too_large_for_memory_is_a_clear_error():
    with pytest.raises(ValueError, match=r"KV cache of 1000000 sessions of 100000 tokens \(.* GiB\) does not fit"):
        KVCache.create(1000, 1_000_000, 8, 100_000, 128, torch.float32, torch.device("cpu"))
    assert KVCache.create(2, 2, 1, 8, 4, torch.float32, torch.device("cpu")).num_free == 2


@pytest.mark.parametrize("lengths", [[(2, 5, 12), (0, 1, 30), (1, 3, 3)],  # a decode token far past the window
                                     [(0, 40, 45), (2, 1, 16), (1, 9, 40)]])  # a prompt longer than the window
def test_sliding_window_attention_sees_only_the_last_window_positions(lengths):
    """Sliding-window layers (Mistral, Gemma 3): each query sees its last 6 positions. The reference is checked
    against a brute-force mask first; every kernel, per segment and padded, must give it, one-token segments too."""
    q, k, v, segments = ragged_batch(lengths, 11)
    window = 6
    want = attention_reference(q, k, v, segments, 0.35, window)
    for seg in segments:  # brute force: a query at position p attends over keys (p - window, p] alone
        for i in range(seg.length):
            p = seg.context_len - seg.length + i
            lo = max(0, p - window + 1)
            one = attention_reference(q[seg.start + i:seg.start + i + 1], k[:, :, lo:], v[:, :, lo:],
                                      [Segment(seg.slot, 0, 1, p + 1 - lo)], 0.35)
            assert torch.allclose(want[seg.start + i], one[0], atol=1e-5)
    assert not torch.allclose(want, attention_reference(q, k, v, segments, 0.35), atol=1e-3)  # the window matters
    masks = causal_masks(segments, q.device, 3, window=window)
    assert torch.allclose(attention_sdpa(q, k, v, segments, 0.35, masks), want, atol=1e-5)
    for seg in segments:
        k[seg.slot, :, seg.context_len:] = float("nan")
    assert torch.allclose(attention_batched(q, k, v, batch_plan(segments, q.device, 3, window=window), 0.35), want,
                          atol=1e-5)
    assert torch.allclose(ATTENTION["reference"][1](q, k, v, segments, 0.35,
                                                    ATTENTION["reference"][0](segments, "cpu", 3, window=window)), want)
