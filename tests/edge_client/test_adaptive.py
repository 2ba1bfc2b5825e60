import pytest

from edge_client.adaptive import AdaptiveDraftLength, RoundSample


def feed(ctrl, rounds, drafted, accepted, draft_s, rtt_s, server_token_s):
    for _ in range(rounds):
        k = ctrl.k
        ctrl.observe(RoundSample(k, min(accepted(k), k), draft_s * k, rtt_s + server_token_s * (k + 1), server_token_s))
    return ctrl.k


def test_high_acceptance_and_cheap_drafting_lengthen_the_draft():
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4)
    assert feed(ctrl, 12, None, lambda k: k, draft_s=0.002, rtt_s=0.05, server_token_s=0.001) == 8


def test_low_acceptance_shortens_the_draft():
    ctrl = AdaptiveDraftLength(k_max=8, k_initial=4)
    assert feed(ctrl, 16, None, lambda k: 0, draft_s=0.01, rtt_s=0.02, server_token_s=0.004) == 1


def test_a_loaded_server_shortens_the_draft_at_the_same_acceptance():
    light = AdaptiveDraftLength(k_max=8, k_initial=4)
    heavy = AdaptiveDraftLength(k_max=8, k_initial=4)
    # Every other round rejects after 2 tokens: alpha around 0.8.
    pattern = lambda k: 2 if pattern.n % 2 else k  # noqa: E731
    pattern.n = 0

    def acc(k):
        pattern.n += 1
        return pattern(k)

    k_light = feed(light, 16, None, acc, draft_s=0.005, rtt_s=0.03, server_token_s=0.001)
    k_heavy = feed(heavy, 16, None, acc, draft_s=0.005, rtt_s=0.03, server_token_s=0.03)
    assert k_heavy < k_light


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        AdaptiveDraftLength(k_max=0)
    assert AdaptiveDraftLength(k_max=3, k_initial=9).k == 3
