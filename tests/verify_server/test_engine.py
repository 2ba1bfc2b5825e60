"""The engine's worker: it outlives whatever one message does."""

import pytest

pytestmark = pytest.mark.model


def test_an_unexpected_error_in_a_message_is_that_message_s_answer_and_the_worker_goes_on(target):
    """A bug in handling one message (here an Open that raises a plain error) answers it INTERNAL; the engine's
    worker stays up and serves the next."""
    import threading

    from verify_server.config import ServerConfig
    from verify_server.engine import Engine
    from verify_server.errors import SledError
    from verify_server.sessions import OpenRequest, SamplingParams

    engine = Engine(ServerConfig(max_sessions=2, max_seq_len=64, fused="off"), target)
    engine.start()
    real = engine._open
    broken = [True]

    def open_once_broken(request, on_verdict=None):
        if broken.pop(0) if broken else False:
            raise RuntimeError("a bug")
        return real(request, on_verdict)

    engine._open = open_once_broken
    replies, got = [], threading.Event()

    def reply(result):
        replies.append(result)
        got.set()

    try:
        for _ in range(2):
            got.clear()
            engine.open(OpenRequest((1, 2, 3), SamplingParams(), 4, frozenset()), reply)
            assert got.wait(30)
    finally:
        engine.stop()
    assert isinstance(replies[0], SledError) and replies[0].code == "INTERNAL" and "a bug" in replies[0].message
    assert not isinstance(replies[1], Exception) and replies[1].tokens == [1, 2, 3]


@pytest.mark.model
def test_a_gguf_target_loads_again_from_its_converted_folder_as_it_was(target, start_cache):
    """The session's `target` converted the default GGUF into the start cache; a second load reads the folder and
    gives the same weights, vocabulary, stop tokens and name."""
    import torch

    from verify_server.model_loader import gguf_key, load_target
    from sled.models import default_model_path

    assert start_cache.get_folder("target", gguf_key(default_model_path(), torch.float32)) is not None
    again = load_target(None, torch.device("cpu"), torch.float32, cache=start_cache)
    assert again.name == target.name and again.fingerprint == target.fingerprint
    assert again.eos_token_ids == target.eos_token_ids and again.vocab_tokens == target.vocab_tokens
    ours, theirs = target.model.state_dict(), again.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
