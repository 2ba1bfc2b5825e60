"""A few dozen fuzz examples against a real server on every run (`sled-bench fuzz` runs many more)."""

import pytest

from stress.fuzz import fuzz, server_facts
from tests.conftest import run

pytestmark = pytest.mark.model


def test_random_message_sequences_never_get_internal_never_hang_and_free_every_slot(make_tiny_server):
    # steps of at least 5 ms, as under load: a cancel can land while an Open waits for the engine (stress.fuzz)
    server = make_tiny_server(max_sessions=8, max_seq_len=256, max_draft_tokens=8, idle_timeout_s=20, min_step_ms=5)
    facts = run(server_facts(server.address))
    assert fuzz(facts, examples=40, call_timeout=30, seed=20261128) == 40
