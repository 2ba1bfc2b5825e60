"""The settings layer both sides share: one set of type rules, tokens from a file or the environment."""

import pytest

from edge_client.config import load_edge_config
from sled.settings import TOKEN_ENV, read_token_file
from verify_server.config import load_config

SIDES = [(load_config, "max_sessions", "server"), (load_edge_config, "max_concurrent", "device")]


@pytest.mark.parametrize("load,name,section", SIDES)
@pytest.mark.parametrize("value,needle", [("true", "must be an integer, got True"),
                                          ("4.0", "must be an integer, got 4.0"),
                                          ("four", "must be an integer, got 'four'"),
                                          ("", "must be set, got nothing")])
def test_both_sides_refuse_what_is_not_a_whole_number_for_an_integer(tmp_path, load, name, section, value, needle):
    f = tmp_path / "s.yaml"
    f.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ValueError, match=f"{name} {needle}"):
        load(f)


@pytest.mark.parametrize("load,name", [(load_config, "max_wait_ms"), (load_edge_config, "round_timeout_s")])
def test_both_sides_take_an_integer_for_a_number(tmp_path, load, name):
    f = tmp_path / "s.yaml"
    f.write_text(f"{name}: 3\n")
    value = getattr(load(f), name)
    assert value == 3.0 and isinstance(value, float)


@pytest.mark.parametrize("load", [load_config, load_edge_config])
def test_a_token_comes_from_a_file_or_the_environment_and_never_empty(tmp_path, load):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    assert load(None, env={}, auth_token_file=str(token_file)).auth_token_file == str(token_file)
    assert read_token_file(token_file) == "s3cret"
    assert load(None, env={TOKEN_ENV: "from-env"}).auth_token == "from-env"
    assert load(None, env={TOKEN_ENV: "from-env"}, auth_token="given").auth_token == "given"
    assert load(None, env={TOKEN_ENV: "from-env"}, auth_token_file=str(token_file)).auth_token is None
    with pytest.raises(ValueError, match="auth_token must not be empty"):
        load(None, env={}, auth_token="")
    with pytest.raises(ValueError, match="not both"):
        load(None, env={}, auth_token="a", auth_token_file=str(token_file))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load(None, env={}, auth_token_file=str(tmp_path / "empty"))


def test_each_side_resolves_its_token():
    from edge_client.config import EdgeConfig
    from verify_server.config import ServerConfig

    assert ServerConfig(auth_token="a").shared_token() == "a" and EdgeConfig(auth_token="a").token() == "a"
    assert ServerConfig().shared_token() is None and EdgeConfig().token() is None


def test_the_server_refuses_a_bad_device_tokens_file(tmp_path):
    f = tmp_path / "devices"
    f.write_text("pi: not-a-hash\n")
    with pytest.raises(ValueError, match="line 1: expected NAME:SHA256HEX"):
        load_config(None, env={}, auth_tokens_file=str(f))
    with pytest.raises(ValueError, match="max_sessions_per_device must be >= 0"):
        load_config(None, env={}, max_sessions_per_device=-1)
