from pathlib import Path

import pytest

from edge_client.config import EdgeConfig, load_edge_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["jetson-orin-nano.yaml", "raspberry-pi-5.yaml"])
def test_shipped_device_configs_load(name):
    cfg = load_edge_config(ROOT / "configs" / name)
    assert cfg.drafter == "llama-cpp" and cfg.server.endswith(":50051")


def test_shipped_server_config_loads():
    from verify_server.config import load_config

    assert load_config(ROOT / "configs" / "server.yaml").port == 50051


def test_flags_override_yaml(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("device:\n  server: a:1\n  drafter: ngram\n  http_port: 9000\n")
    cfg = load_edge_config(f, drafter="cacheback", http_port=None)
    assert (cfg.server, cfg.drafter, cfg.http_port) == ("a:1", "cacheback", 9000)
    f.write_text("flash_attn: true\n")
    assert load_edge_config(f).flash_attn and not load_edge_config(f, flash_attn=False).flash_attn
    assert not EdgeConfig().flash_attn


@pytest.mark.parametrize("text,needle", [
    ("drafter: gpt\n", "drafter must be one of"),
    ("fallback: pray\n", "fallback must be one of"),
    ("server: nowhere\n", "HOST:PORT"),
    ("draft_tokens: -1\n", ">= 0"),
    ("max_concurrent: 0\n", "max_concurrent must be positive"),
    ("drafter: onnx\n", "needs onnx_model"),
    ("http_port: eighty\n", "http_port must be an integer"),
    ("flash_attn: maybe\n", "flash_attn must be true or false"),
    ("colour: red\n", "unknown device settings ['colour']"),
])
def test_bad_settings_are_clear_errors(tmp_path, text, needle):
    f = tmp_path / "d.yaml"
    f.write_text(text)
    with pytest.raises(ValueError) as err:
        load_edge_config(f)
    assert needle in str(err.value)


def test_defaults_are_valid():
    assert EdgeConfig().drafter == "llama-cpp"
