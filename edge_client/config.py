"""Device agent configuration: a frozen dataclass that checks itself, loaded from YAML in one function."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sled.settings import check_token, load_settings, read_token_file

from .drafters.base import DrafterOptions
from .policy import DraftPolicy
from .resilience import FALLBACKS, Resilience
from .servers import check_servers
from .transport import TLS, read_ca, read_client_pair


@dataclass(frozen=True)
class EdgeConfig:
    # verify server HOST:PORT; several: a list (in YAML, or comma-separated) or dns:///NAME:PORT (every address the
    # name resolves to); a device's sessions stay on one healthy server of them (edge_client/servers.py)
    server: str | list[str] = "127.0.0.1:50051"
    drafter: str = "llama-cpp"  # llama-cpp | onnx | parallel | cacheback | ngram | none | stacked | stack:PROPOSER+MODEL
    draft_model: str | None = None  # GGUF for llama-cpp; None: the SmolLM2 default
    onnx_model: str | None = None  # .onnx for the onnx and parallel drafters
    tokenizer: str | None = None  # GGUF whose vocabulary tokenizes (default: draft_model)
    # How the device drafts (DraftPolicy, whose defaults these are): K when adaptive_draft is off (0: no drafting);
    # K chosen each round from acceptance, round trip and server load; the adaptive K's upper bound and first value;
    # drafting on while a draft is verified; the adaptive draft ending early at a token the drafter is unsure of.
    draft_tokens: int = DraftPolicy.draft_tokens
    adaptive_draft: bool = DraftPolicy.adaptive
    max_draft_tokens: int = DraftPolicy.max_draft_tokens
    draft_ahead: bool = DraftPolicy.draft_ahead
    confidence_stop: bool = DraftPolicy.confidence_stop
    mask_drafts: bool = DraftPolicy.mask_drafts  # under a constraint, draft only what it allows
    forced_tokens: bool = DraftPolicy.forced_tokens  # and draft what it forces without the drafter
    # How the server verifies: a rule of sled/verification.py as NAME[:KEY=VALUE,...]; None: the server's default.
    verification: str | None = DraftPolicy.verification
    threads: int | None = None  # llama.cpp / ONNX Runtime threads
    gpu_layers: int = DrafterOptions.gpu_layers  # llama.cpp layers offloaded to the GPU (Jetson)
    # llama.cpp flash attention, on as in llama.cpp itself (llama-cpp-python turns it off unless asked): faster
    # drafting for slightly less agreement with the target (docs/device.md, "Drafters").
    flash_attn: bool = DrafterOptions.flash_attn
    context_size: int = DrafterOptions.context_size  # drafter context
    auth_token: str | None = None  # the verify server's bearer token (or SLED_AUTH_TOKEN in the environment)
    auth_token_file: str | None = None  # a file whose first line is that token, to keep it out of the config
    # TLS to the verify server: on when tls is true, or when it is unset and tls_ca or tls_cert is set; tls_ca: the
    # PEM CA certificates to trust (None: the system's); tls_server_name: the name the server's certificate carries
    # where the server's address does not (an IP address); tls_cert and tls_key: this device's PEM certificate chain
    # and private key, both or neither, for a server that requires client certificates (mutual TLS).
    tls: bool | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # While the server is unreachable (Resilience, whose defaults these are): wait | local | fail; how long `wait`
    # waits; the deadline of one round and of one Open.
    fallback: str = Resilience.fallback
    wait_deadline_s: float = Resilience.wait_deadline_s
    round_timeout_s: float = Resilience.round_timeout_s
    http_host: str = "127.0.0.1"  # the local OpenAI-compatible API
    http_port: int = 8080
    # When set, the local API's /v1 routes take only requests that carry it (`Authorization: Bearer KEY`, the
    # OpenAI clients' api_key); /health stays open. None: no key asked (local apps on a loopback address).
    http_api_key: str | None = None
    max_concurrent: int = 4  # local requests generating at once (each its own session and drafter)
    max_queued: int = 64  # local requests waiting for one of those; past them a request is answered 503 at once
    model_name: str = "sled"  # the id /v1/models reports
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        from .drafters import check_drafter_name, stack_layers

        check_drafter_name(self.drafter)
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if isinstance(self.server, list):
            if not all(isinstance(s, str) for s in self.server):
                raise ValueError(f"server must be HOST:PORT or a list of them, got {self.server!r}")
            object.__setattr__(self, "server", ",".join(self.server))
        check_server(self.server)
        for name in ("context_size", "max_concurrent", "default_max_tokens", "wait_deadline_s", "round_timeout_s"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        check_token(self.auth_token, self.auth_token_file)
        self.draft_policy()  # checks the drafting and verification settings
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be at least 1, got {self.max_draft_tokens}")
        if self.draft_tokens < 0 or self.gpu_layers < 0:
            raise ValueError("draft_tokens and gpu_layers must be >= 0")
        if self.http_api_key is not None and not self.http_api_key.strip():
            raise ValueError("http_api_key must not be empty: leave it unset for no key")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in 0..65535, got {self.http_port}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if "onnx" in (self.drafter, (stack_layers(self.drafter) or ("", ""))[1]) and not self.onnx_model:
            raise ValueError("the onnx drafter needs onnx_model (a file made by scripts/export_onnx_draft.py)")
        if self.drafter == "parallel" and not self.onnx_model:
            raise ValueError("the parallel drafter needs onnx_model (a file made by sled-train parallel)")
        if self.tls is False:
            for name in ("tls_ca", "tls_cert"):
                if getattr(self, name) is not None:
                    raise ValueError(f"tls is false but {name} is set: drop {name} for a plain connection, or tls "
                                     "for TLS")
        if self.tls_server_name is not None and not self.uses_tls:
            raise ValueError("tls_server_name applies to TLS: set tls: true (or tls_ca)")
        if self.tls_ca is not None:
            read_ca(self.tls_ca)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (a client certificate) or neither")
        if self.tls_cert is not None:
            read_client_pair(self.tls_cert, self.tls_key)

    def draft_policy(self) -> DraftPolicy:
        return DraftPolicy(draft_tokens=self.draft_tokens, adaptive=self.adaptive_draft,
                           max_draft_tokens=self.max_draft_tokens, draft_ahead=self.draft_ahead,
                           confidence_stop=self.confidence_stop, mask_drafts=self.mask_drafts,
                           forced_tokens=self.forced_tokens,
                           verification=self.verification)

    def resilience(self) -> Resilience:
        return Resilience(fallback=self.fallback, wait_deadline_s=self.wait_deadline_s,
                          round_timeout_s=self.round_timeout_s)

    def drafter_options(self) -> DrafterOptions:
        return DrafterOptions(model_path=self.draft_model, onnx_model=self.onnx_model, threads=self.threads,
                              gpu_layers=self.gpu_layers, flash_attn=self.flash_attn, context_size=self.context_size)

    def token(self) -> str | None:
        """The bearer token to send: auth_token, or the first line of auth_token_file."""
        return read_token_file(self.auth_token_file) if self.auth_token_file is not None else self.auth_token

    @property
    def uses_tls(self) -> bool:
        # tls false with tls_ca or tls_cert is refused above
        return bool(self.tls) or self.tls_ca is not None or self.tls_cert is not None

    def channel_tls(self) -> TLS | None:
        """How the device reaches its server: over TLS, or (None) a plain connection."""
        if not self.uses_tls:
            return None
        return TLS.load(self.tls_ca, self.tls_server_name, self.tls_cert, self.tls_key)


def check_server(address: str) -> str:
    """The verify servers' HOST:PORT, a comma-separated list of them or dns:///NAME:PORT, checked: gRPC would take
    a missing port as 443."""
    return check_servers(address)


def load_edge_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                     **overrides: Any) -> EdgeConfig:
    """Read YAML (if given; a top-level `device:` section is accepted), apply non-None overrides, check. Where
    neither sets a token it may come from SLED_AUTH_TOKEN (`env`, os.environ by default)."""
    return load_settings(EdgeConfig, path, "device", overrides, env)
