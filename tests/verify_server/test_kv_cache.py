import pytest
import torch

from kernels.attention import Segment, attention_reference, attention_sdpa
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


def test_sdpa_attention_matches_reference_on_a_ragged_batch():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 16, 8, generator=g)  # [slots, kv_heads, max_len, dim]
    v = torch.randn(3, 2, 16, 8, generator=g)
    segments = [Segment(2, 0, 5, 12), Segment(0, 5, 1, 7), Segment(1, 6, 3, 3)]
    q = torch.randn(9, 6, 8, generator=g)  # 6 query heads over 2 kv heads
    want = attention_reference(q, k, v, segments, 0.35)
    assert torch.allclose(attention_sdpa(q, k, v, segments, 0.35), want, atol=1e-5)
    # Rolling back is a length: positions past context_len never leak in.
    k2 = k.clone()
    k2[2, :, 12:] = 1e4
    assert torch.allclose(attention_reference(q, k2, v, segments, 0.35), want)
