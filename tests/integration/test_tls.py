"""TLS between a device and the verify server: the same text over TLS as over a plain connection, the bearer token
checked inside it, and a clear failure for a device that does not trust the certificate or does not speak TLS."""

import pytest
import trustme

from edge_client.drafters import create_drafter
from edge_client.generation import generate
from edge_client.request import Request
from edge_client.resilience import Resilience
from edge_client.policy import DraftPolicy
from edge_client.transport import TLS, VerifierClient, VerifyError
from tests.conftest import ServerThread, run

pytestmark = pytest.mark.model

PROMPT = [1, 504, 3458, 314, 1345, 30]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, and a certificate of it for localhost / 127.0.0.1 and one for a name only ("sled.internal")."""
    out = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(out / "ca.pem"))
    for name, hosts in (("local", ("localhost", "127.0.0.1")), ("named", ("sled.internal",))):
        cert = ca.issue_cert(*hosts)
        cert.cert_chain_pems[0].write_to_path(str(out / f"{name}.pem"))
        cert.private_key_pem.write_to_path(str(out / f"{name}-key.pem"))
    stranger_ca = trustme.CA()
    stranger_ca.cert_pem.write_to_path(str(out / "other-ca.pem"))
    # devices' client certificates (mutual TLS): one the CA signed, one another CA signed
    for name, issuer in (("device", ca), ("stranger", stranger_ca)):
        cert = issuer.issue_cert(f"{name}-7")
        cert.cert_chain_pems[0].write_to_path(str(out / f"{name}.pem"))
        cert.private_key_pem.write_to_path(str(out / f"{name}-key.pem"))
    return out


def serve(tiny, pki=None, cert="local", **settings):
    from verify_server.config import ServerConfig

    tls = dict(tls_cert=str(pki / f"{cert}.pem"), tls_key=str(pki / f"{cert}-key.pem")) if pki else {}
    return ServerThread(ServerConfig(host="127.0.0.1", port=0, max_sessions=4, max_seq_len=256, seed=0,
                                     target="random:llama-tiny", **tls, **settings), tiny).load()


def greedy(address, tokenizer, tls=None, auth_token=None, fallback="fail"):
    async def go():
        client = VerifierClient(address, auth_token, tls=tls)
        try:
            return await generate(
                client,
                create_drafter("ngram"),
                tokenizer,
                Request(PROMPT, max_tokens=16, policy=DraftPolicy(draft_tokens=4, adaptive=False)),
                resilience=Resilience(fallback=fallback, wait_deadline_s=2.0, round_timeout_s=5.0),
            )
        finally:
            await client.close()

    return run(go())


@pytest.fixture(scope="module")
def plain_text(tiny, tokenizer):
    server = serve(tiny)
    try:
        return greedy(server.address, tokenizer).token_ids
    finally:
        server.stop()


def test_a_device_gets_the_same_text_over_tls_with_the_token_checked(tiny, tokenizer, pki, plain_text):
    server = serve(tiny, pki, auth_token="s3cret")
    try:
        result = greedy(server.address, tokenizer, TLS.load(pki / "ca.pem"), auth_token="s3cret")
        assert result.token_ids == plain_text and len(plain_text) == 16
        assert result.rounds > 0 and result.unverified_tokens == 0
        with pytest.raises(VerifyError) as refused:  # the token is still checked over TLS
            greedy(server.address, tokenizer, TLS.load(pki / "ca.pem"), auth_token="wrong")
        assert refused.value.code == "UNAUTHENTICATED"
    finally:
        server.stop()


def test_a_device_that_does_not_trust_the_certificate_or_speaks_plain_is_refused_at_once(tiny, tokenizer, pki):
    server = serve(tiny, pki)
    try:
        for tls, says in ((TLS.load(pki / "other-ca.pem"), "CERTIFICATE_VERIFY_FAILED"),
                          (None, "Socket closed (a server that speaks TLS closes a plain connection this way: if it "
                                 "does, set tls (--tls))")):
            with pytest.raises(VerifyError) as failed:  # the fail policy: UNAVAILABLE, not a wait's deadline
                greedy(server.address, tokenizer, tls)
            assert failed.value.code == "UNAVAILABLE" and says in failed.value.message
        assert server.engine.metrics.sessions_opened == 0
    finally:
        server.stop()


def test_a_server_that_requires_client_certificates_serves_only_devices_with_one_it_trusts(tiny, tokenizer, pki,
                                                                                           plain_text):
    server = serve(tiny, pki, tls_client_ca=str(pki / "ca.pem"))
    try:
        device = TLS.load(pki / "ca.pem", cert_file=pki / "device.pem", key_file=pki / "device-key.pem")
        result = greedy(server.address, tokenizer, device)
        assert result.token_ids == plain_text and result.unverified_tokens == 0
        hint = ("(a server that requires client certificates closes the connection this way where the device presents "
                "none (tls_cert, tls_key) or one it does not trust)")
        for refused in (TLS.load(pki / "ca.pem"),
                        TLS.load(pki / "ca.pem", cert_file=pki / "stranger.pem", key_file=pki / "stranger-key.pem")):
            with pytest.raises(VerifyError) as failed:
                greedy(server.address, tokenizer, refused)
            assert failed.value.code == "UNAVAILABLE" and f"Socket closed {hint}" in failed.value.message
        assert server.engine.metrics.sessions_opened == 1  # the refused devices never reached a session
        assert greedy(server.address, tokenizer, device).token_ids == plain_text  # and the server goes on
        # the certificate names the device, in the per-device metrics
        assert server.engine.metrics.registry.get_sample_value("sled_device_sessions_total",
                                                               {"device": "device-7"}) == 2
    finally:
        server.stop()


def test_a_server_reached_by_address_is_checked_against_the_name_given(tiny, tokenizer, pki, plain_text):
    server = serve(tiny, pki, cert="named")  # a certificate for sled.internal only, reached at 127.0.0.1
    try:
        with pytest.raises(VerifyError) as failed:
            greedy(server.address, tokenizer, TLS.load(pki / "ca.pem"))
        assert failed.value.code == "UNAVAILABLE"
        named = TLS.load(pki / "ca.pem", server_name="sled.internal")
        assert greedy(server.address, tokenizer, named).token_ids == plain_text
    finally:
        server.stop()


def test_a_tls_device_against_a_plain_server_fails_and_the_server_goes_on(tiny, tokenizer, pki, plain_text):
    server = serve(tiny)
    try:
        with pytest.raises(VerifyError) as failed:
            greedy(server.address, tokenizer, TLS.load(pki / "ca.pem"))
        assert failed.value.code == "UNAVAILABLE"
        assert "WRONG_VERSION_NUMBER" in failed.value.message
        assert "(the server does not seem to speak TLS: if so, leave tls off)" in failed.value.message
        assert greedy(server.address, tokenizer).token_ids == plain_text
    finally:
        server.stop()



def test_sled_edge_info_over_tls(tiny, pki, capsys):
    from edge_client.cli import main

    server = serve(tiny, pki)
    try:
        assert main(["info", "--server", server.address, "--tls-ca", str(pki / "ca.pem")]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"server {server.address}\n  target: random:llama-tiny")
        for flags, says in (([], "Socket closed (a server that speaks TLS closes"),  # plain at a TLS server
                            (["--tls-ca", str(pki / "other-ca.pem")], "CERTIFICATE_VERIFY_FAILED")):
            assert main(["info", "--server", server.address, "--timeout", "1", *flags]) == 1
            err = capsys.readouterr().err
            assert err.startswith(f"sled-edge info: no answer from {server.address} within 1s (the last connection "
                                  "attempt: UNAVAILABLE: ") and says in err, err
    finally:
        server.stop()


def test_sled_edge_info_with_a_client_certificate(tiny, pki, capsys):
    from edge_client.cli import main

    server = serve(tiny, pki, tls_client_ca=str(pki / "ca.pem"))
    try:
        mine = ["--tls-cert", str(pki / "device.pem"), "--tls-key", str(pki / "device-key.pem")]
        assert main(["info", "--server", server.address, "--tls-ca", str(pki / "ca.pem"), *mine]) == 0
        assert capsys.readouterr().out.startswith(f"server {server.address}\n  target: random:llama-tiny")
        assert main(["info", "--server", server.address, "--timeout", "1", "--tls-ca", str(pki / "ca.pem")]) == 1
        err = capsys.readouterr().err
        assert "Socket closed (a server that requires client certificates closes the connection" in err, err
    finally:
        server.stop()


def test_the_device_agent_daemon_serves_through_a_tls_server(make_server, pki, tmp_path, tokenizer,
                                                             reference_greedy):
    import subprocess

    from openai import OpenAI

    from tests.integration.test_processes import BIN

    server = make_server(tls_cert=str(pki / "local.pem"), tls_key=str(pki / "local-key.pem"), auth_token="s3cret")
    cfg = tmp_path / "device.yaml"
    cfg.write_text(f"server: localhost:{server.server.port}\ntls_ca: {pki / 'ca.pem'}\nauth_token: s3cret\n"
                   "context_size: 1024\nhttp_port: 0\n")
    proc = subprocess.Popen([BIN / "sled-edge", "serve", "--config", str(cfg), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"(verify server localhost:{server.server.port} over TLS, drafter llama-cpp)" in line, line
        client = OpenAI(base_url=line.split("on ", 1)[1].split(" ", 1)[0], api_key="unused")
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.encode(tokenizer.chat_prompt(messages))
        r = client.chat.completions.create(model="sled", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == tokenizer.decode(reference_greedy(tuple(ids), 24))
        assert r.model_extra["sled"]["accepted_tokens"] > 0 and r.model_extra["sled"]["unverified_tokens"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
