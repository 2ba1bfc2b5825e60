import dataclasses
from pathlib import Path

import pytest
import trustme

from edge_client.config import EdgeConfig, load_edge_config
from edge_client.drafters.base import DrafterOptions
from edge_client.transport import TLS

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
    f.write_text("flash_attn: false\n")
    assert not load_edge_config(f).flash_attn and load_edge_config(f, flash_attn=True).flash_attn
    assert EdgeConfig().flash_attn and DrafterOptions().flash_attn  # on by default, as llama.cpp's own 'auto'


def test_flash_attention_is_on_unless_turned_off(tmp_path):
    from edge_client.cli import build_parser, edge_config

    parse = build_parser().parse_args
    assert edge_config(parse(["generate", "hi"])).flash_attn is True
    assert edge_config(parse(["generate", "hi", "--no-flash-attn"])).flash_attn is False
    assert edge_config(parse(["serve"])).flash_attn is True
    assert edge_config(parse(["serve", "--no-flash-attn"])).flash_attn is False
    off = tmp_path / "off.yaml"
    off.write_text("flash_attn: false\n")
    assert edge_config(parse(["serve", "--config", str(off)])).flash_attn is False
    assert edge_config(parse(["serve", "--config", str(off), "--flash-attn"])).flash_attn is True


@pytest.mark.parametrize("text,needle", [
    ("drafter: gpt\n", "unknown drafter 'gpt'; choose one of"),
    ("drafter: stack:ngram+gpt\n", "a stacked drafter is stack:PROPOSER+MODEL"),
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


@pytest.mark.parametrize("setting", ["wait_deadline_s", "round_timeout_s"])
def test_a_nan_deadline_is_refused(setting):
    from edge_client.resilience import Resilience

    with pytest.raises(ValueError, match=setting):
        EdgeConfig(**{setting: float("nan")})
    with pytest.raises(ValueError, match=setting):
        Resilience(**{setting: float("nan")})


def test_the_device_config_turns_tls_on_and_checks_its_files(tmp_path):
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    assert load_edge_config().channel_tls() is None
    assert load_edge_config(tls=True).channel_tls() == TLS(None, None)  # the system's CA certificates
    yaml_file = tmp_path / "device.yaml"
    yaml_file.write_text(f"device:\n  server: 10.0.0.5:50051\n  tls_ca: {tmp_path / 'ca.pem'}\n"
                         "  tls_server_name: sled.internal\n")
    config = load_edge_config(yaml_file)  # tls_ca alone turns TLS on
    assert config.uses_tls and config.channel_tls() == TLS((tmp_path / "ca.pem").read_bytes(), "sled.internal")
    assert dataclasses.replace(config, tls_ca=None, tls=True).channel_tls() == TLS(None, "sled.internal")
    with pytest.raises(ValueError, match="tls is false but tls_ca is set"):  # `--no-tls` over that file
        load_edge_config(yaml_file, tls=False)
    (tmp_path / "junk.pem").write_text("not a certificate")
    for settings, says in ((dict(tls_ca=str(tmp_path / "junk.pem")), "cannot read CA certificates"),
                           (dict(tls_ca=str(tmp_path / "none.pem")), "No such file"),
                           (dict(tls_server_name="sled.internal"), "tls_server_name applies to TLS"),
                           (dict(tls=False, tls_ca=str(tmp_path / "ca.pem")), "tls is false but tls_ca is set"),
                           (dict(tls="yes"), "tls must be true or false")):
        with pytest.raises(ValueError, match=says):
            load_edge_config(**settings)


def test_a_device_certificate_turns_tls_on_and_is_checked_as_a_pair(tmp_path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    mine, other = ca.issue_cert("device-7"), ca.issue_cert("device-8")
    mine.cert_chain_pems[0].write_to_path(str(tmp_path / "device.pem"))
    mine.private_key_pem.write_to_path(str(tmp_path / "device-key.pem"))
    other.private_key_pem.write_to_path(str(tmp_path / "other-key.pem"))
    pem = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "device", "device-key", "other-key", "none")}
    config = load_edge_config(tls_ca=pem["ca"], tls_cert=pem["device"], tls_key=pem["device-key"])
    assert config.channel_tls() == TLS((tmp_path / "ca.pem").read_bytes(), None,
                                       (tmp_path / "device.pem").read_bytes(), (tmp_path / "device-key.pem").read_bytes())
    # a certificate alone turns TLS on, trusting the system's CA certificates for the server's
    assert load_edge_config(tls_cert=pem["device"], tls_key=pem["device-key"]).channel_tls().ca is None
    assert load_edge_config(tls_ca=pem["ca"]).channel_tls().cert_chain is None  # no client certificate by default
    for settings, says in ((dict(tls_cert=pem["device"]), "tls_cert and tls_key go together"),
                           (dict(tls_key=pem["device-key"]), "tls_cert and tls_key go together"),
                           (dict(tls_cert=pem["device"], tls_key=pem["other-key"]), "KEY_VALUES_MISMATCH"),
                           (dict(tls_cert=pem["none"], tls_key=pem["device-key"]), "No such file"),
                           (dict(tls=False, tls_cert=pem["device"], tls_key=pem["device-key"]),
                            "tls is false but tls_cert is set")):
        with pytest.raises(ValueError, match=says):
            load_edge_config(**settings)


def test_a_device_config_that_is_not_yaml_is_one_line_naming_where(tmp_path, capsys):
    from edge_client.cli import main

    f = tmp_path / "device.yaml"
    f.write_text("server: 10.0.0.5:50051\n\t- x\n")
    assert main(["serve", "--config", str(f)]) == 2
    assert capsys.readouterr().err == (f"sled-edge serve: {f}, line 2, column 1: not valid YAML (found character "
                                       "'\\t' that cannot start any token)\n")


def test_max_queued_may_be_zero_but_not_negative():
    assert load_edge_config(max_queued=0).max_queued == 0  # no waiting: a request past max_concurrent is refused
    with pytest.raises(ValueError, match="max_queued must be >= 0, got -1"):
        load_edge_config(max_queued=-1)


def test_each_default_is_written_once_and_every_command_builds_through_edge_config():
    """The drafting, resilience and drafter defaults live in DraftPolicy, Resilience and DrafterOptions; EdgeConfig
    takes them from there, and a flag not given leaves it to EdgeConfig, for generate, serve and workload alike."""
    from dataclasses import fields

    from edge_client.cli import build_parser, edge_config
    from edge_client.config import EdgeConfig
    from edge_client.drafters.base import DrafterOptions
    from edge_client.policy import DraftPolicy
    from edge_client.resilience import Resilience

    plain = EdgeConfig()
    assert plain.draft_policy() == DraftPolicy()
    assert plain.resilience() == Resilience()
    assert plain.drafter_options() == DrafterOptions()
    parse = build_parser().parse_args
    for argv in (["generate", "hi"], ["serve"], ["workload"]):
        assert edge_config(parse(argv)) == plain, argv
    names = {f.name for f in fields(EdgeConfig)}
    for argv in (["generate", "hi"], ["serve"], ["workload"]):  # no flag carries a default of its own
        assert all(v is None for k, v in vars(parse(argv)).items() if k in names), argv
    given = edge_config(parse(["generate", "hi", "--no-adaptive", "--draft-tokens", "6", "--wait-deadline", "9",
                               "--round-timeout", "3", "--gpu-layers", "2"]))
    assert given.draft_policy() == DraftPolicy(draft_tokens=6, adaptive=False)
    assert given.resilience() == Resilience(wait_deadline_s=9.0, round_timeout_s=3.0)
    assert given.drafter_options().gpu_layers == 2
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert f"(default {DraftPolicy.max_draft_tokens})" in helps["max_draft_tokens"]
    assert f"(default {Resilience.wait_deadline_s:g})" in helps["wait_deadline_s"]
