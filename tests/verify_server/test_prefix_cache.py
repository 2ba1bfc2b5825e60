import torch

from verify_server.kv_cache import KVCache
from verify_server.prefix_cache import PrefixCache

HEADER = list(range(100, 120))  # 20 tokens every prompt below starts with


def pool(slots=4, max_len=64):
    return KVCache(2, slots, 1, max_len, 4, torch.float32, torch.device("cpu"))


def prefill(kv, slot, prompt):
    """Stand-in for the model: the KV at a position is a function of the tokens up to it."""
    ids = torch.tensor(prompt, dtype=torch.float32)
    for pos in range(len(prompt) - 1):
        kv.k[:, slot, :, pos] = ids[: pos + 1].sum() + pos
        kv.v[:, slot, :, pos] = -ids[: pos + 1].sum()
    return len(prompt) - 1


def test_what_two_different_prompts_share_is_kept_and_loaded_exactly():
    kv = pool()
    cache = PrefixCache(kv, max_tokens=256)
    a, b = HEADER + [1, 2, 3], HEADER + [7, 8]
    cache.observe(0, a, prefill(kv, 0, a))
    assert len(cache) == 0  # one prompt alone shares nothing yet
    cache.observe(1, b, prefill(kv, 1, b))
    assert len(cache) == 1 and cache.tokens == 20
    c = HEADER + [9, 9, 9, 9]
    want = pool()
    prefill(want, 0, c)
    kv.k[:, 2].fill_(float("nan"))
    kv.v[:, 2].fill_(float("nan"))
    assert cache.load(2, c) == 20
    assert torch.equal(kv.k[:, 2, :, :20], want.k[:, 0, :, :20])
    assert torch.equal(kv.v[:, 2, :, :20], want.v[:, 0, :, :20])
    assert kv.k[:, 2, :, 20:].isnan().all()  # nothing past the shared part is written


def test_a_prompt_repeated_whole_is_not_kept_whole():
    kv = pool()
    cache = PrefixCache(kv, max_tokens=256)
    a = HEADER + [1, 2, 3]
    cache.observe(0, a, prefill(kv, 0, a))
    cache.observe(1, a, prefill(kv, 1, a))
    assert len(cache) == 0 and cache.load(2, a) == 0


def test_a_partial_match_loads_only_the_common_part_and_short_ones_none():
    kv = pool()
    cache = PrefixCache(kv, max_tokens=256, min_tokens=16)
    a, b = HEADER + [1, 2], HEADER + [3, 4]
    cache.observe(0, a, prefill(kv, 0, a))
    cache.observe(1, b, prefill(kv, 1, b))
    diverges = HEADER[:17] + [5, 5, 5, 5, 5]
    assert cache.load(2, diverges) == 17
    want = pool()
    prefill(want, 0, diverges)
    assert torch.equal(kv.k[:, 2, :, :17], want.k[:, 0, :, :17])
    assert cache.load(3, HEADER[:10] + [5] * 10) == 0  # under min_tokens
    assert cache.load(3, HEADER + [5]) == 20
    assert cache.load(3, HEADER) == 19  # the last context token is never loaded: it is computed


def test_the_longest_entry_wins_and_a_longer_one_replaces_its_prefix():
    kv = pool(slots=6)
    cache = PrefixCache(kv, max_tokens=256)
    p = [HEADER + [1], HEADER + [2], HEADER + [3, 4, 5, 6, 7, 8, 1], HEADER + [3, 4, 5, 6, 7, 8, 2]]
    for slot, prompt in enumerate(p):
        cache.observe(slot, prompt, prefill(kv, slot, prompt))
    assert len(cache) == 1 and cache.tokens == 26  # the 20-token entry was dropped for the 26-token one
    assert cache.load(5, HEADER + [3, 4, 5, 6, 7, 8, 9, 9]) == 26
    assert cache.load(5, HEADER + [9, 9]) == 20


def test_least_recently_used_entries_go_first_under_the_token_budget():
    kv = pool(slots=8)
    cache = PrefixCache(kv, max_tokens=45)
    heads = [[h] * 20 for h in (1, 2, 3)]
    slot = 0
    for head in heads[:2]:
        for tail in ([7], [8]):
            prompt = head + tail
            cache.observe(slot % 8, prompt, prefill(kv, slot % 8, prompt))
            slot += 1
    assert len(cache) == 2 and cache.tokens == 40
    assert cache.load(7, heads[0] + [9]) == 20  # entry 1 is now the most recent
    for tail in ([7], [8]):
        prompt = heads[2] + tail
        cache.observe(slot % 8, prompt, prefill(kv, slot % 8, prompt))
        slot += 1
    assert cache.tokens <= 45
    assert cache.load(7, heads[1] + [9]) == 0  # the least recently used went
    assert cache.load(7, heads[0] + [9]) == 20
    assert cache.load(7, heads[2] + [9]) == 20


def test_an_entry_outlives_its_slot_and_zero_turns_the_cache_off():
    kv = pool()
    cache = PrefixCache(kv, max_tokens=256)
    a, b = HEADER + [1], HEADER + [2]
    cache.observe(0, a, prefill(kv, 0, a))
    cache.observe(1, b, prefill(kv, 1, b))
    want = kv.k[:, 1, :, :20].clone()
    kv.k[:, :2].zero_()  # both slots reused by other sessions
    assert cache.load(3, HEADER + [5]) == 20 and torch.equal(kv.k[:, 3, :, :20], want)
    off = PrefixCache(kv, max_tokens=0)
    off.observe(0, a, 20)
    off.observe(1, b, 20)
    assert len(off) == 0 and off.load(3, HEADER + [5]) == 0
