"""sled-edge generate: bad settings are refused with a one-line error before any model loads."""

import pytest

from edge_client.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--max-draft-tokens", "0"], "--max-draft-tokens must be at least 1, got 0"),
    (["--max-tokens", "-5"], "--max-tokens must be at least 1, got -5"),
    (["--gpu-layers", "-1"], "--gpu-layers must be at least 0, got -1"),
    (["--draft-tokens", "-1"], "--draft-tokens must be at least 0, got -1"),
    (["--seed", "-1"], "seed must be in [0, 2**63), got -1"),
    (["--wait-deadline", "nan"], "wait_deadline_s must be positive, got nan"),
])
def test_bad_generate_settings_are_one_line_errors(flags, message, capsys):
    # a draft model that does not exist: reaching the model load would say "does not exist" instead
    assert main(["generate", "hi", "--draft-model", "/nowhere/draft.gguf", *flags]) == 2
    assert capsys.readouterr().err == f"sled-edge: {message}\n"
