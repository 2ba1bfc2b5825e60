"""Who a device is: a per-device token (a file of NAME:SHA256), the shared token, or its certificate's subject."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Identity:
    name: str  # for logs and quotas
    authenticated: bool  # named by a credential (token file, certificate), not by its network address

    @property
    def label(self) -> str:
        """The per-device metrics label: a named device's name, else one label for all (addresses are unbounded)."""
        return self.name if self.authenticated else "anonymous"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def parse_device_tokens(text: str, source: str = "auth_tokens_file") -> dict[str, str]:
    """SHA-256 hex -> device name, from lines `NAME:HEX` (blank lines and # comments skipped)."""
    by_hash: dict[str, str] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, digest = line.partition(":")
        name, digest = name.strip(), digest.strip().lower()
        if not sep or not NAME.fullmatch(name) or not HEX.fullmatch(digest):
            raise ValueError(f"{source}, line {number}: expected NAME:SHA256HEX (a name of letters, digits, "
                             "'.', '_', '@', '-' and the 64 hex digits of sha256(token))")
        if name in names:
            raise ValueError(f"{source}, line {number}: device {name} is listed twice")
        if digest in by_hash:
            raise ValueError(f"{source}, line {number}: {name} has the same token as {by_hash[digest]}")
        names.add(name)
        by_hash[digest] = name
    return by_hash


class AuthThrottle:
    """Slows failed authentication from one host: each failure is answered after the previous one's answer plus a
    delay that doubles with every failure (from `base`, at most `max_delay`), so guesses from one host come at most
    one per max_delay however many streams carry them. A host quiet for `forget_s` starts again from `base`."""

    def __init__(self, base: float = 0.05, max_delay: float = 2.0, forget_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.base, self.max_delay, self.forget_s, self.clock = base, max_delay, forget_s, clock
        self._hosts: dict[str, tuple[int, float]] = {}  # host -> (failures, when its last refusal is answered)
        self._lock = threading.Lock()

    def failure(self, host: str) -> float:
        """Record a failure from `host`; returns how long to wait before refusing it."""
        with self._lock:
            now = self.clock()
            failures, answered = self._hosts.get(host, (0, now))
            if now - answered > self.forget_s:
                failures, answered = 0, now
            delay = min(self.base * 2 ** failures, self.max_delay)
            answered = max(answered, now) + delay
            self._hosts[host] = (failures + 1, answered)
            if len(self._hosts) > 4096:  # forget the quietest hosts first
                for old in sorted(self._hosts, key=lambda h: self._hosts[h][1])[:1024]:
                    del self._hosts[old]
            return answered - now

    def failures(self, host: str) -> int:
        return self._hosts.get(host, (0, 0.0))[0]


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000', 'unix:/path')."""
    _, _, rest = peer.partition(":")
    if peer.startswith(("ipv4:", "ipv6:")):
        return rest.rsplit(":", 1)[0].strip("[]")
    return rest or peer


def certificate_name(auth_context: dict) -> str | None:
    """The name a verified client certificate (mutual TLS) gives: its common name, else its first subject
    alternative name; None without one."""
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth_context.get(key) or []:
            if value:  # gRPC gives an empty common name for a certificate without one
                return value.decode("utf-8", "replace")
    return None


class Authenticator:
    """Checks an Open's token and names the device.

    With device tokens (auth_tokens_file) or a shared token configured, an Open must carry one of them: a device
    token names the device; the shared token names it by its certificate (mutual TLS) or its address. With neither,
    every Open is taken, named the same way."""

    def __init__(self, shared_token: str | None = None, tokens_file: str | None = None):
        self.shared_token = shared_token
        self.tokens_file = tokens_file
        self._by_hash: dict[str, str] = {}
        self.throttle = AuthThrottle()
        if tokens_file is not None:
            self.reload()

    @property
    def required(self) -> bool:
        return self.shared_token is not None or self.tokens_file is not None

    @property
    def devices(self) -> int:
        return len(self._by_hash)

    def reload(self) -> int:
        """Read the device tokens file again (on SIGHUP): a device no longer listed is refused at its next Open.
        A file that cannot be read or parsed keeps the tokens held so far and raises ValueError."""
        if self.tokens_file is None:
            return 0
        try:
            text = Path(self.tokens_file).read_text()
        except OSError as err:
            raise ValueError(f"auth_tokens_file {self.tokens_file}: {err.strerror or err}") from None
        self._by_hash = parse_device_tokens(text, f"auth_tokens_file {self.tokens_file}")
        return len(self._by_hash)

    def identify(self, token: str, peer: str, auth_context: dict) -> Identity | None:
        """The device's identity, or None when its token is refused."""
        if token:
            name = self._by_hash.get(token_hash(token))
            if name is not None:
                return Identity(name, True)
        if self.required and not (self.shared_token is not None and token
                                  and hmac.compare_digest(token.encode(), self.shared_token.encode())):
            return None
        subject = certificate_name(auth_context)
        if subject is not None:
            return Identity(subject, True)
        return Identity(peer_host(peer), False)
