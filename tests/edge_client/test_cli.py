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
    (["--verification", "fly", "--temperature", "0.7"],
     "fly verification applies to greedy generation (temperature 0) only"),
    (["--verification", "fly:window=-2"], "fly's window must be an integer in [1, 64), got -2"),
    (["--verification", "loose"], "verification 'loose' is not a rule: one of exact, fly"),
])
def test_bad_generate_settings_are_one_line_errors(flags, message, capsys):
    # a draft model that does not exist: reaching the model load would say "does not exist" instead
    assert main(["generate", "hi", "--draft-model", "/nowhere/draft.gguf", *flags]) == 2
    assert capsys.readouterr().err == f"sled-edge: {message}\n"


def test_tls_settings_are_checked_before_anything_connects_or_loads(tmp_path, capsys):
    from verify_server.cli import main as server_main

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    assert main(["info", "--server", "127.0.0.1:5", "--tls-server-name", "sled.internal"]) == 2
    assert capsys.readouterr().err == "sled-edge info: --tls-server-name applies to TLS: give --tls (or --tls-ca)\n"
    assert main(["generate", "hi", "--draft-model", "/nowhere/draft.gguf", "--tls-ca", str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sled-edge: tls_ca {junk}: cannot read CA certificates from it (") and "\n" == err[-1:]
    assert main(["serve", "--tls-server-name", "sled.internal"]) == 2
    assert capsys.readouterr().err == "sled-edge serve: tls_server_name applies to TLS: set tls: true (or tls_ca)\n"
    assert server_main(["--tls-cert", str(junk)]) == 2
    assert capsys.readouterr().err == ("sled-server: bad configuration: tls_cert and tls_key go together: give both "
                                       "(TLS) or neither\n")
    # mutual TLS: the device's own certificate and key go together, the server's client CA needs its TLS
    assert main(["info", "--server", "127.0.0.1:5", "--tls-key", str(junk)]) == 2
    assert capsys.readouterr().err == ("sled-edge info: tls_cert and tls_key go together: give both (a client "
                                       "certificate) or neither\n")
    assert main(["generate", "hi", "--draft-model", "/nowhere/draft.gguf", "--tls-cert", str(junk), "--tls-key",
                 str(junk)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sled-edge: tls_cert {junk} and tls_key {junk}: not a usable certificate and key (")
    assert main(["serve", "--tls-cert", str(junk), "--no-tls"]) == 2
    assert capsys.readouterr().err == ("sled-edge serve: tls is false but tls_cert is set: drop tls_cert for a plain "
                                       "connection, or tls for TLS\n")
    assert server_main(["--tls-client-ca", str(junk)]) == 2
    assert capsys.readouterr().err == ("sled-server: bad configuration: tls_client_ca applies to TLS: give tls_cert "
                                       "and tls_key too\n")


def test_a_model_path_that_is_a_folder_says_so(tmp_path, capsys):
    assert main(["generate", "hi", "--server", "127.0.0.1:5", "--draft-model", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"sled-edge: model file {tmp_path} is a folder, not a GGUF file\n"
    assert main(["generate", "hi", "--server", "127.0.0.1:5", "--drafter", "onnx", "--onnx-model", str(tmp_path)]) == 2
    # the default GGUF's vocabulary loads first for the tokenizer, and llama.cpp may log a line of its own
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"sled-edge: ONNX draft model {tmp_path} is a folder, not an .onnx file", err
