from edge_client.drafters import DrafterOptions, create_drafter
from edge_client.drafters.cacheback import CachebackDrafter, LRUTable
from edge_client.sampling import SamplingParams


def drafter(**kw):
    return CachebackDrafter(DrafterOptions(), **kw)


def test_lru_table_keeps_most_recent_followers_and_evicts_old_leaders():
    t = LRUTable(capacity=2, followers=2)
    t.put((1,), (2, 3))
    t.put((1,), (4, 5))
    t.put((1,), (6, 7))
    assert t.get((1,)) == (6, 7)
    assert t._rows[(1,)] == [(6, 7), (4, 5)]
    t.put((1,), (4, 5))  # seen again: back to the front
    assert t.get((1,)) == (4, 5)
    t.put((8,), (9, 9))
    t.get((1,))  # (1,) is now the most recently used
    t.put((10,), (11, 11))
    assert t.get((8,)) is None and t.get((1,)) == (4, 5) and len(t) == 2


def test_chained_lookups_replay_a_repeated_phrase():
    d = drafter(leader_lengths=(2,), follower_length=2)
    phrase = [10, 11, 12, 13, 14, 15, 16]
    context = [1, 2] + phrase + [3, 4, 10, 11]
    d.begin(context, SamplingParams())
    assert d.propose(context, 5).token_ids == [12, 13, 14, 15, 16]


def test_longer_leaders_win_and_misses_stop_the_chain():
    d = drafter(leader_lengths=(2, 1), follower_length=1)
    context = [5, 7, 1, 6, 7, 2, 9, 5, 7]
    d.begin(context, SamplingParams())
    # leader (5, 7) was followed by 1; leader (7,) most recently by 2.
    assert d.propose(context, 3).token_ids == [1, 6, 7]  # (5,7)->1, (7,1)->6, (1,6)->7
    assert d.propose([4, 7], 1).token_ids == [2]  # (4,7) unseen: falls back to (7,), most recently -> 2
    assert d.propose([99], 3).token_ids == []


def test_committed_chunks_update_the_tables():
    d = drafter(leader_lengths=(1,), follower_length=2)
    context = [1, 2, 3]
    d.begin(context, SamplingParams())
    assert d.propose(context, 2).token_ids == []
    context += [8, 9, 3]
    d.accept(context)
    assert d.propose(context, 2).token_ids == [8, 9]


def test_tables_persist_across_sessions():
    d = create_drafter("cacheback")
    d.begin([1, 2, 3, 4, 5, 6, 7], SamplingParams())
    d.begin([9, 2, 3], SamplingParams())
    assert d.propose([9, 2, 3], 3).token_ids == [4, 5, 6]
