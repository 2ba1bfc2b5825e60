import pytest

from verify_server.config import ServerConfig, load_config


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("port: 6000\nmax_sessions: 8\nmax_wait_ms: 2\n")
    cfg = load_config(f, max_sessions=4, host=None)
    assert (cfg.port, cfg.max_sessions, cfg.max_wait_ms, cfg.host) == (6000, 4, 2.0, "127.0.0.1")


def test_server_section_is_accepted(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("server:\n  port: 6001\n")
    assert load_config(f).port == 6001


@pytest.mark.parametrize("text,needle", [
    ("max_sessions: 0\n", "max_sessions must be positive"),
    ("port: 70000\n", "port must be in"),
    ("max_batch_tokens: 4\n", "must hold one full draft"),
    ("max_sessions: many\n", "max_sessions must be an integer"),
    ("max_wait_ms: fast\n", "max_wait_ms must be a number"),
    ("dtype: int8\n", "dtype must be"),
    ("linear: fast\n", "linear must be auto, onednn or reference"),
    ("colour: blue\n", "unknown server settings ['colour']"),
    ("- a list\n", "expected a mapping"),
])
def test_bad_settings_raise_value_error(tmp_path, text, needle):
    f = tmp_path / "s.yaml"
    f.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(f)
    assert needle in str(err.value)


def test_config_is_frozen():
    with pytest.raises(Exception):
        ServerConfig().port = 1
