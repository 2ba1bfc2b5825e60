"""What one verification commits: stop tokens and max_tokens cut the accepted block."""

from verify_server.sessions import LENGTH, STOP, commit_tokens

EOS = frozenset({2})


def test_plain_block_commits_accepted_plus_next():
    assert commit_tokens([5, 6, 7], 2, 9, EOS, remaining=10) == (2, 9, None)


def test_eos_inside_accepted_block_stops_there_and_drops_the_rest():
    assert commit_tokens([5, 2, 7], 3, 9, EOS, remaining=10) == (2, None, STOP)


def test_eos_as_next_token_stops():
    assert commit_tokens([5, 6], 2, 2, EOS, remaining=10) == (2, 2, STOP)


def test_max_tokens_reached_inside_block_cuts_there():
    assert commit_tokens([5, 6, 7, 8], 4, 9, EOS, remaining=2) == (2, None, LENGTH)


def test_max_tokens_reached_exactly_with_next_token():
    assert commit_tokens([5, 6], 2, 9, EOS, remaining=3) == (2, 9, LENGTH)


def test_eos_exactly_at_the_limit_is_a_stop():
    assert commit_tokens([5, 2], 2, 9, EOS, remaining=2) == (2, None, STOP)


def test_request_stop_tokens_count_like_eos():
    assert commit_tokens([5, 6, 7], 3, 9, EOS | {6}, remaining=10) == (2, None, STOP)
