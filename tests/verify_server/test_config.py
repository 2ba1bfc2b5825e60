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
    ("fused: fast\n", "fused must be auto, on or off"),
    ("fused_max_tokens: -1\n", "fused_max_tokens must be >= 0"),
    ("prefix_cache_tokens: -1\n", "prefix_cache_tokens must be >= 0"),
    ("min_step_ms: -1\n", "min_step_ms must be in [0, 60000) ms"),
    ("min_step_ms_per_token: .nan\n", "min_step_ms_per_token must be in [0, 60000) ms"),
    ("min_step_ms: slow\n", "min_step_ms must be a number"),
    ("colour: blue\n", "unknown server settings ['colour']"),
    ("verification: loose\n", "verification 'loose' is not a rule: one of exact, fly"),
    ("verification: fly\nrefuse_verification: [fly]\n", "verification fly is the default and refused"),
    ("refuse_verification: [loose]\n", "refuse_verification: 'loose' is not a rule"),
    ("verification_params: ['fly:window=0']\n", "fly's window must be an integer in [1, 64), got 0"),
    ("verification_params: fly\n", "verification_params must be a list of strings"),
    ("verification: fly\nmax_draft_tokens: 4\n", "verification fly: its window must be below max_draft_tokens (4)"),
    ("verification: 'fly:entropy_threshold=nan'\n", "fly's entropy_threshold must be a number in [0, 10), got nan"),
    ("verification: 'fly:window'\n", "'window' is not KEY=NUMBER"),
    ("target: random:llama-3b\n", "random target must be random:NAME (llama-1b, llama-8b, llama-tiny)"),
    ("target: random:/nowhere/shape.json\n", "random target config /nowhere/shape.json does not exist"),
    ("tokenizer: /tmp\n", "tokenizer applies to random targets only"),
    ("target: random:llama-tiny\ntokenizer: /nowhere/tok\n", "tokenizer /nowhere/tok is not a folder"),
    ("- a list\n", "expected a mapping"),
    (": :\n", "s.yaml, line 1, column 1: not valid YAML (expected <block end>, but found ':')"),
    ("port: 1\nhost: \"x\n", "s.yaml, line 3, column 1: not valid YAML (found unexpected end of stream)"),
    ("a: \x07\n", "s.yaml: not valid YAML (unacceptable character #x0007: special characters are not allowed"),
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


def test_random_target_shapes_from_names_and_json(tmp_path):
    from verify_server.model_loader import random_target_shape

    assert load_config(None, target="random:llama-1b").target == "random:llama-1b"
    assert random_target_shape("random:llama-8b")["num_hidden_layers"] == 32
    f = tmp_path / "shape.json"
    f.write_text('{"hidden_size": 32, "num_hidden_layers": 1}')
    assert random_target_shape(f"random:{f}") == {"hidden_size": 32, "num_hidden_layers": 1}
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_config(None, target=f"random:{f}")


def test_a_random_target_takes_a_tokenizer_folder(tmp_path):
    assert load_config(None, target="random:llama-1b", tokenizer=str(tmp_path)).tokenizer == str(tmp_path)


def test_a_cuda_device_without_cuda_is_a_clear_error():
    import torch

    from verify_server.model_loader import resolve_device

    if torch.cuda.is_available():
        bad = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(ValueError, match=f"only {torch.cuda.device_count()} CUDA GPU"):
            resolve_device(bad)
    else:
        with pytest.raises(ValueError, match="device 'cuda' asked for, but .*use cpu or auto"):
            resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_target_that_is_neither_a_gguf_nor_a_model_folder_is_a_clear_error(tmp_path):
    import torch

    from verify_server.model_loader import load_target

    (tmp_path / "notes.txt").write_text("not a model")
    for path, says in ((tmp_path, "is a folder without config.json; give a Hugging Face model folder"),
                       (tmp_path / "notes.txt", "is a file but not a .gguf")):
        with pytest.raises(ValueError, match=f"target {path} {says}"):
            load_target(str(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("setting", ["max_wait_ms", "idle_timeout_s"])
def test_a_nan_time_setting_is_refused(setting):
    # NaN passed the old `< 0` and `<= 0` checks; a NaN batching window left steps to wait for full batches
    with pytest.raises(ValueError, match=setting):
        ServerConfig(**{setting: float("nan")})


def test_tls_needs_a_certificate_and_its_own_key(tmp_path):
    import trustme

    ca = trustme.CA()
    cert, stranger = ca.issue_cert("localhost"), ca.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    stranger.private_key_pem.write_to_path(str(tmp_path / "other-key.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    pem = {name: str(tmp_path / f"{name}.pem") for name in ("cert", "key", "other-key", "junk", "none")}
    cfg = load_config(tls_cert=pem["cert"], tls_key=pem["key"])
    assert (cfg.tls_cert, cfg.tls_key) == (pem["cert"], pem["key"])
    for settings, says in ((dict(tls_cert=pem["cert"]), "tls_cert and tls_key go together"),
                           (dict(tls_key=pem["key"]), "tls_cert and tls_key go together"),
                           (dict(tls_cert=pem["cert"], tls_key=pem["other-key"]), "KEY_VALUES_MISMATCH"),
                           (dict(tls_cert=pem["junk"], tls_key=pem["key"]), "not a usable certificate and key"),
                           (dict(tls_cert=pem["none"], tls_key=pem["key"]), "No such file")):
        with pytest.raises(ValueError, match=says):
            load_config(**settings)


def test_mutual_tls_needs_tls_and_a_readable_client_ca(tmp_path):
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert = ca.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    pem = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key", "junk", "none")}
    tls = dict(tls_cert=pem["cert"], tls_key=pem["key"])
    assert load_config(**tls).tls_mode == " over TLS"
    assert load_config(**tls, tls_client_ca=pem["ca"]).tls_mode == " over mutual TLS"
    assert load_config().tls_mode == ""
    for settings, says in ((dict(tls_client_ca=pem["ca"]), "tls_client_ca applies to TLS: give tls_cert and tls_key"),
                           (dict(tls, tls_client_ca=pem["junk"]), f"tls_client_ca {pem['junk']}: cannot read CA"),
                           (dict(tls, tls_client_ca=pem["none"]), "No such file")):
        with pytest.raises(ValueError, match=says):
            load_config(**settings)


