"""scripts/replay_confidence.py's replay, over synthetic recordings whose confidences do or do not tell."""

from __future__ import annotations

import random

from scripts.replay_confidence import MODELS, replay


def recordings(sure_right: float, sure_wrong: float, length: int = 400, start: int = 10, short_at: int | None = None):
    """One recorded output: at context n the drafter proposes 0-8 right tokens (drawn, seeded by n), then wrong ones,
    sure_right of each right token and sure_wrong of each wrong one. At short_at the proposal is cut to 2 tokens (a
    drafter that reached its end of text)."""
    full = list(range(length))
    table, confidence = {}, {}
    for n in range(start, length):
        right = full[n:n + random.Random(n).randint(0, 8)]
        table[n] = right + [-1] * (8 - len(right))
        confidence[n] = [sure_right] * len(right) + [sure_wrong] * (8 - len(right))
        if n == short_at:
            table[n], confidence[n] = table[n][:2], confidence[n][:2]
    return [(full, start, table, confidence)]


def test_a_telling_confidence_ends_drafts_at_the_wrong_token_and_saves_server_time():
    rec = recordings(0.95, 0.05)
    for model in MODELS.values():
        off_s, _ = replay(rec, model, confidence_stop=False)
        on_s, _ = replay(rec, model)
        assert on_s < 0.95 * off_s
    # llama.cpp's fixed p_min cuts at the first unsure token too (the first token always goes).
    _, drafted = replay(rec, MODELS["cpu-server"], k=8, p_min=0.75)
    assert 1 <= drafted < 6


def test_a_confidence_that_tells_nothing_changes_little():
    rec = recordings(0.5, 0.5)
    for model in MODELS.values():
        off_s, _ = replay(rec, model, confidence_stop=False)
        on_s, _ = replay(rec, model)
        assert 0.9 * off_s < on_s < 1.1 * off_s


def test_a_proposal_shorter_than_k_is_replayed_as_far_as_it_goes():
    rec = recordings(0.95, 0.05, short_at=50)
    for k in (None, 8):
        s, drafted = replay(rec, MODELS["device-bound"], k=k, p_min=0.75 if k else None)
        assert s > 0 and drafted >= 1
    s8, _ = replay(rec, MODELS["cpu-server"], k=8)
    assert s8 > 0
