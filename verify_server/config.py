"""Server configuration: a frozen dataclass that checks itself, loaded from YAML in one function."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sled.settings import check_token, load_settings, read_token_file
from sled.verification import RULES, Verification

from .auth import Authenticator


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # GGUF file or Hugging Face model folder; None means the SmolLM2-135M-Instruct GGUF;
    # random:llama-1b | random:llama-8b | random:FILE.json: a Llama of that shape with random weights.
    target: str | None = None
    # A random target's vocabulary: a Hugging Face tokenizer folder (scripts/export_tokenizer.py writes the default
    # GGUF's), for machines without the GGUF (a GPU node); None reads it from the default GGUF.
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    # Ranks the target's heads and MLP columns are split over (verify_server/tensor_parallel.py): on CUDA one GPU each
    # (cuda:0 .. cuda:N-1), on the CPU processes sharing its cores.
    tensor_parallel: int = 1
    max_sessions: int = 32  # sessions held at once
    max_seq_len: int = 2048  # context tokens per session (prompt + generated)
    # The paged KV pool: blocks of kv_block_size tokens, kv_cache_tokens in all (None: on CUDA, kv_memory_fraction
    # of the memory free once the weights are loaded; elsewhere max_sessions x max_seq_len). Sessions hold blocks
    # for what they hold, not for max_seq_len.
    kv_block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float = 0.8
    max_batch_sessions: int = 16  # verification requests in one step
    max_batch_tokens: int = 512  # tokens (draft + prefill) in one step
    # Prompt chunks (docs/architecture.md, "Prefill"): while a draft waits, or a session's next draft is due before a
    # step of max_batch_tokens would end, a step prefills only what keeps it within step_target_ms (None: twice
    # the step's fitted fixed cost), at least prefill_min_tokens; otherwise up to max_batch_tokens. Idle sessions do
    # not count. prefill_chunk_tokens, where set, is the chunk in place of the one step_target_ms gives.
    step_target_ms: float | None = None
    prefill_min_tokens: int = 16
    prefill_chunk_tokens: int | None = None
    max_wait_ms: float = 5.0  # longest a request waits for others to join its step, from the worker's intake
    max_draft_tokens: int = 16  # longest accepted draft
    max_draft_top_k: int = 64  # largest sparse draft distribution per token
    # Full blocks of committed tokens are shared by reference with later sessions whose context starts with the same
    # tokens (a system prompt); blocks no session holds keep their prefix up to this many tokens, until the pool
    # needs them. 0 turns prefix sharing off.
    prefix_cache_tokens: int = 4096
    idle_timeout_s: float = 300.0  # a session without traffic this long is freed
    drain_s: float = 5.0  # on SIGTERM: NOT_SERVING at once, sessions under way get this long, then the process ends
    # How drafts are verified where an Open does not say, a rule of sled/verification.py as NAME[:KEY=VALUE,...]
    # (a greedy-only rule applies to greedy sessions; the others are verified exactly). verification_params: rules'
    # parameters for the sessions that ask for them without giving them, NAME:KEY=VALUE,... each;
    # refuse_verification: rules whose sessions are refused.
    verification: str = "exact"
    verification_params: list[str] | None = None
    refuse_verification: list[str] | None = None
    auth_token: str | None = None  # when set, Open must carry it (or a device token of auth_tokens_file)
    auth_token_file: str | None = None  # a file whose first line is auth_token, to keep it off the command line
    # Per-device credentials: lines NAME:SHA256HEX (the hex SHA-256 of that device's token, so the file holds no
    # secret); an Open must carry one of these tokens (or auth_token) and the device is named NAME. Reread on SIGHUP.
    auth_tokens_file: str | None = None
    max_sessions_per_device: int = 0  # sessions one device may hold at once; 0: no limit beyond max_sessions
    # TLS: the server's PEM certificate chain and its private key, both or neither; with them the port speaks TLS
    # only (devices set tls, and tls_ca where the certificate's CA is not in their system's store).
    tls_cert: str | None = None
    tls_key: str | None = None
    # Mutual TLS: PEM CA certificates; with them every device must present a certificate they signed (its tls_cert
    # and tls_key), or its connection is closed in the handshake. Needs tls_cert.
    tls_client_ca: str | None = None
    metrics_port: int | None = None  # Prometheus exporter; None disables it
    # Projection kernel: auto (onednn on CPU where it works, else reference) | onednn | reference.
    linear: str = "auto"
    # The whole forward in one C call for batches of up to fused_max_tokens tokens (float32 on CPU, built at first
    # use with the system C compiler): auto (where it builds, else PyTorch) | on (it or an error) | off.
    fused: str = "auto"
    # The step compiled whole (verify_server/compiled.py): its tokens padded to a few buckets, under torch.compile
    # (CUDA graphs on CUDA, inductor's C++ on the CPU), every bucket compiled at start; attention is FlexAttention
    # over the pool on CUDA and the runner's per-segment kernel, as one op of the graph, on the CPU.
    # auto: on CUDA; off on the CPU, where compiling every bucket takes minutes on a small host. Steps the fused CPU
    # step takes stay with it.
    compile: str = "auto"
    # Past it PyTorch's oneDNN matmuls win, once many rows share each weight read, at a count that depends on the
    # CPU. None: timed at start-up, one session's forward of 1-256 tokens through both (docs/kernels.md).
    fused_max_tokens: int | None = None
    # What start-up measures (fused_max_tokens where unset) is kept in start_cache_dir (None: the folder the fused
    # step's builds are kept in, under "start") keyed by machine, target, dtype, threads and kernel build, so a
    # restart skips it; start_cache false measures at every start. calibration_budget_s bounds the measuring.
    start_cache: bool = True
    start_cache_dir: str | None = None
    calibration_budget_s: float = 15.0
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    seed: int | None = None  # seed for sessions that ask for none (reproducible runs)
    # A floor under every forward: it lasts at least min_step_ms + min_step_ms_per_token * its tokens, the rest slept.
    # For capacity experiments only: a small random target with the floor has a GPU's step profile (nearly flat in
    # the step's tokens) on a CPU, so the devices' side of a GPU run can be studied without one. 0 (off) by default.
    min_step_ms: float = 0.0
    min_step_ms_per_token: float = 0.0

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

        for name in ("max_sessions", "max_seq_len", "max_batch_sessions", "max_batch_tokens",
                     "max_draft_tokens", "max_draft_top_k", "idle_timeout_s", "drain_s", "tensor_parallel",
                     "kv_block_size"):
            positive(name)
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if self.prefill_min_tokens <= 0:
            raise ValueError(f"prefill_min_tokens must be positive, got {self.prefill_min_tokens}")
        if self.step_target_ms is not None and not 0 < self.step_target_ms < 60_000:  # also refuses NaN
            raise ValueError(f"step_target_ms must be in (0, 60000) ms, got {self.step_target_ms!r}")
        self._check_verification()
        if self.max_sessions_per_device < 0:
            raise ValueError(f"max_sessions_per_device must be >= 0 (0: no limit), got {self.max_sessions_per_device}")
        check_token(self.auth_token, self.auth_token_file)
        if self.auth_tokens_file is not None:
            Authenticator(tokens_file=self.auth_tokens_file)  # reads and checks it
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.max_seq_len:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one whole session "
                             f"(max_seq_len {self.max_seq_len})")
        if not 0 < self.kv_memory_fraction <= 0.95:  # also refuses NaN
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction!r}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if not 0 <= self.max_wait_ms < 60_000:  # also refuses NaN
            raise ValueError(f"max_wait_ms must be in [0, 60000) ms, got {self.max_wait_ms}")
        if self.max_batch_tokens < self.max_draft_tokens + 1:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must hold one full draft "
                f"(max_draft_tokens + 1 = {self.max_draft_tokens + 1})"
            )
        if self.max_draft_tokens + 2 > self.max_seq_len:
            raise ValueError("max_seq_len must exceed max_draft_tokens + 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.linear not in ("auto", "onednn", "reference"):
            raise ValueError(f"linear must be auto, onednn or reference, got {self.linear!r}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be auto, on or off, got {self.compile!r}")
        if self.fused not in ("auto", "on", "off"):
            raise ValueError(f"fused must be auto, on or off, got {self.fused!r}")
        if self.fused_max_tokens is not None and self.fused_max_tokens < 0:
            raise ValueError(f"fused_max_tokens must be >= 0, got {self.fused_max_tokens}")
        if self.target is not None and self.target.startswith("random:"):
            from .model_loader import random_target_shape

            random_target_shape(self.target)
        if self.tokenizer is not None:
            if self.target is None or not self.target.startswith("random:"):
                raise ValueError("tokenizer applies to random targets only: a GGUF file or model folder carries its "
                                 "own tokenizer")
            if not Path(self.tokenizer).is_dir():
                raise ValueError(f"tokenizer {self.tokenizer} is not a folder (a Hugging Face tokenizer folder, as "
                                 "scripts/export_tokenizer.py writes)")
        if self.tensor_parallel > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"tensor_parallel {self.tensor_parallel} takes cuda:0 to cuda:{self.tensor_parallel - 1}: "
                             f"set device to cuda or auto, not {self.device}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.metrics_port is not None and not 0 < self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 1..65535, got {self.metrics_port}")
        for name in ("min_step_ms", "min_step_ms_per_token"):
            value = getattr(self, name)
            if not 0 <= value < 60_000:  # also refuses NaN
                raise ValueError(f"{name} must be in [0, 60000) ms, got {value!r}")
        if not 0 < self.calibration_budget_s < 3600:  # also refuses NaN
            raise ValueError(f"calibration_budget_s must be in (0, 3600) s, got {self.calibration_budget_s!r}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (TLS) or neither")
        if self.tls_cert is not None:
            check_tls_pair(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None:
            if self.tls_cert is None:
                raise ValueError("tls_client_ca applies to TLS: give tls_cert and tls_key too")
            check_ca(self.tls_client_ca)

    def _check_verification(self) -> None:
        for field_, items in (("verification_params", self.verification_params),
                              ("refuse_verification", self.refuse_verification)):
            listed = isinstance(items, (list, tuple)) and all(isinstance(x, str) for x in items)
            if items is not None and not listed:
                raise ValueError(f"{field_} must be a list of strings, got {items!r}")
        default = Verification.parse(self.verification)
        for name in self.refuse_verification or ():
            if name not in RULES:
                raise ValueError(f"refuse_verification: {name!r} is not a rule: one of {', '.join(RULES)}")
        if default.name in (self.refuse_verification or ()):
            raise ValueError(f"verification {default.name} is the default and refused (refuse_verification)")
        least = default.spec.min_draft_tokens(default.resolved(self.params_for(default.name)))
        if least > self.max_draft_tokens:  # other rules' are checked at each Open that asks for them
            raise ValueError(f"verification {default}: its {default.spec.drafts_over} must be below "
                             f"max_draft_tokens ({self.max_draft_tokens})")

    def params_for(self, name: str) -> dict[str, float]:
        """A rule's parameters as this server sets them (its default's, then verification_params, which win)."""
        values: dict[str, float] = {}
        for text in [self.verification, *(self.verification_params or ())]:
            rule = Verification.parse(text)
            if rule.name == name:
                values.update(rule.params)
        return values

    def start_cache_folder(self) -> Path | None:
        """Where start-up measurements are kept; None where start_cache is off."""
        if not self.start_cache:
            return None
        if self.start_cache_dir is not None:
            return Path(self.start_cache_dir)
        from kernels.cpu_step import cache_dir

        return cache_dir() / "start"

    def shared_token(self) -> str | None:
        """The token every device may use: auth_token, or the first line of auth_token_file."""
        if self.auth_token_file is not None:
            return read_token_file(self.auth_token_file)
        return self.auth_token

    @property
    def tls_mode(self) -> str:
        """How the port speaks, for the start-up lines: '' (plain), ' over TLS' or ' over mutual TLS'."""
        if self.tls_cert is None:
            return ""
        return " over mutual TLS" if self.tls_client_ca is not None else " over TLS"


def check_tls_pair(cert: str, key: str) -> None:
    """A certificate chain and private key that Python's own TLS accepts as a pair: gRPC reports a bad or
    mismatched one only as 'Failed to bind to address'."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except OSError as err:  # ssl.SSLError is one: a missing file, no PEM in it, a key that is not the certificate's
        raise ValueError(f"tls_cert {cert} and tls_key {key}: not a usable certificate and key "
                         f"({err.strerror or err})") from None


def check_ca(path: str) -> None:
    """PEM CA certificates that Python's own TLS can read: gRPC would only fail every device's handshake."""
    try:
        ssl.create_default_context(cafile=path)
    except OSError as err:  # ssl.SSLError is one
        raise ValueError(f"tls_client_ca {path}: cannot read CA certificates from it ({err.strerror or err})") from None


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                **overrides: Any) -> ServerConfig:
    """Read YAML (if given; a top-level `server:` section is accepted), apply non-None overrides, check everything.
    Where neither sets a shared token it may come from SLED_AUTH_TOKEN (`env`, os.environ by default)."""
    return load_settings(ServerConfig, path, "server", overrides, env)
