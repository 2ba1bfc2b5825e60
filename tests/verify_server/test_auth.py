"""Device identity: per-device hashed tokens, the shared token, certificate subjects, and the failure throttle."""

import pytest

from verify_server.auth import AuthThrottle, Authenticator, Identity, parse_device_tokens, peer_host, token_hash

PEER = "ipv4:10.0.0.7:51234"


def tokens_file(tmp_path, **devices):
    path = tmp_path / "devices.tokens"
    path.write_text("# device tokens\n" + "".join(f"{name}:{token_hash(tok)}\n" for name, tok in devices.items()))
    return path


def test_a_device_token_names_its_device_and_a_revoked_one_is_refused_after_reload(tmp_path):
    path = tokens_file(tmp_path, jetson_1="tok-a", pi_2="tok-b")
    auth = Authenticator(tokens_file=str(path))
    assert auth.identify("tok-a", PEER, {}) == Identity("jetson_1", True)
    assert auth.identify("tok-b", PEER, {}) == Identity("pi_2", True)
    assert auth.identify("tok-c", PEER, {}) is None
    assert auth.identify("", PEER, {}) is None
    path.write_text(f"pi_2:{token_hash('tok-b')}\n")  # jetson_1 revoked
    assert auth.reload() == 1
    assert auth.identify("tok-a", PEER, {}) is None
    assert auth.identify("tok-b", PEER, {}) == Identity("pi_2", True)


def test_a_bad_reload_keeps_the_tokens_in_force(tmp_path):
    path = tokens_file(tmp_path, jetson_1="tok-a")
    auth = Authenticator(tokens_file=str(path))
    path.write_text("jetson_1 has no hash\n")
    with pytest.raises(ValueError, match="line 1: expected NAME:SHA256HEX"):
        auth.reload()
    assert auth.identify("tok-a", PEER, {}) == Identity("jetson_1", True)


def test_the_shared_token_keeps_working_beside_device_tokens(tmp_path):
    auth = Authenticator(shared_token="shared", tokens_file=str(tokens_file(tmp_path, jetson_1="tok-a")))
    assert auth.identify("shared", PEER, {}) == Identity("10.0.0.7", False)
    assert auth.identify("tok-a", PEER, {}) == Identity("jetson_1", True)
    assert auth.identify("shared-not", PEER, {}) is None


def test_a_client_certificate_names_the_device():
    context = {"x509_common_name": [b"orin-17"], "transport_security_type": [b"ssl"]}
    assert Authenticator().identify("", PEER, context) == Identity("orin-17", True)
    assert Authenticator(shared_token="s").identify("s", PEER, context) == Identity("orin-17", True)
    assert Authenticator(shared_token="s").identify("", PEER, context) is None
    # a certificate with no common name (gRPC gives an empty one) is named by its subject alternative name
    san_only = {"x509_common_name": [b""], "x509_subject_alternative_name": [b"pi-3"]}
    assert Authenticator().identify("", PEER, san_only) == Identity("pi-3", True)


def test_without_credentials_a_device_is_its_address():
    auth = Authenticator()
    assert not auth.required
    assert auth.identify("", "ipv6:[::1]:5000", {}) == Identity("::1", False)
    assert Identity("::1", False).label == "anonymous" and Identity("pi", True).label == "pi"


@pytest.mark.parametrize("text,needle", [
    ("jetson\n", "line 1: expected NAME:SHA256HEX"),
    ("jetson:abc\n", "line 1: expected NAME:SHA256HEX"),
    (f"bad name:{'0' * 64}\n", "line 1: expected NAME:SHA256HEX"),
    (f"a:{'0' * 64}\na:{'1' * 64}\n", "line 2: device a is listed twice"),
    (f"a:{'0' * 64}\nb:{'0' * 64}\n", "line 2: b has the same token as a"),
])
def test_bad_token_files_name_the_line(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_device_tokens(text)


def test_upper_case_hex_and_comments_are_taken():
    assert parse_device_tokens(f"# fleet\n\npi-4:{'AB' * 32}  # kitchen\n") == {"ab" * 32: "pi-4"}


def test_failures_from_one_host_are_answered_ever_later_and_forgotten_after_quiet():
    now = [0.0]
    throttle = AuthThrottle(base=0.05, max_delay=2.0, forget_s=60.0, clock=lambda: now[0])
    delays = [throttle.failure("10.0.0.7") for _ in range(8)]
    # each refusal comes after the one before it, each later by a doubling step, at most max_delay
    assert delays == pytest.approx([0.05, 0.15, 0.35, 0.75, 1.55, 3.15, 5.15, 7.15])
    assert throttle.failure("10.0.0.8") == pytest.approx(0.05)  # another host is not slowed
    now[0] = 200.0  # quiet for long: forgotten
    assert throttle.failure("10.0.0.7") == pytest.approx(0.05)


def test_peer_hosts():
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[2001:db8::1]:443") == "2001:db8::1"
    assert peer_host("unix:/tmp/sock") == "/tmp/sock"
